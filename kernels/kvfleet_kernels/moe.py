"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): torch reference and a Triton grouped GEMM.

Each token picks top_k experts (topk_ids [T, K], weights topk_weights [T, K]); expert e is a
gated MLP: w13[e] = [gate | up] ([2I, H]), w2[e] ([H, I]). The output of a token is the sum of
its experts' outputs, each times its weight.

The Triton path runs every expert in two launches of one grouped GEMM (vLLM's fused_moe
design): the (token, k) pairs sorted by expert, each expert's run padded to BLOCK_M rows
(`moe_align`), a program a block of BLOCK_M pairs of one expert x BLOCK_N outputs, gathering its
rows of the input. `moe_align` runs on the device with shapes fixed by T, K and the expert
count (no host sync), so the decode graphs capture it; blocks past the padded total exit.

A decode step of a few tokens takes another path (`use_gemv`): a GEMV a (token, k) pair,
no sorting. The up kernel computes a pair's SiLU(gate) * up from its expert's w13 rows; the
down kernel a token's output, summing its top_k experts' w2 GEMVs times their weights. Two
launches in all, each expert's weights read once a pair (the grouped path adds the grouping's
two and the SiLU's and the pair sum's). `moe_align_triton` is the grouping on the device in
two launches (`moe_align`: the same in torch ops, some twenty launches; for the largest
steps); `moe_route` the router's softmax, top-k and renormalization in one launch
(moe_route_ref: HF's ops).

Weights: bf16 / fp16, e4m3 with a scale a row (FP8), or `IntExperts` (GPTQ / AWQ int4 / int8
groups), which both paths read as words and dequantize in registers (a quarter / half of the
bf16 bytes read). Act-order IntExperts (GPTQ desc_act: each expert's inputs sorted by group,
`perm`) take their inputs gathered through the expert's permutation first, a row a (token, k)
pair (`_gather_inputs`, one launch), which both paths then read as the down projection reads its
per-pair activations.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.activation import silu_and_mul, silu_mul
from kvfleet_kernels.w4a16 import _small_int_to_float, _split_words


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                       ) -> torch.Tensor:
    """Stacked expert weights [E, N, K], e4m3 with per-(expert, row) scales [E, N], in dtype."""
    return w if scale is None else (w.float() * scale[:, :, None]).to(dtype)


@dataclass(frozen=True)
class IntExperts:
    """Weight-only int4 / int8 experts (GPTQ, AWQ), stacked as the bf16 ones ([E, N, K]):
      qweight: [E, N, K // P] int32, P = 32 // bits; word [e, n, j] holds k = j * P + i at
               bits [i * bits, (i + 1) * bits), unsigned: a row's K inputs packed along the
               last dim, as a bf16 row's are contiguous (a GEMV row reads whole words)
      scales:  [E, N, G] fp16 / bf16 / fp32, G = K // group_size; zeros: [E, N, G] the same
               dtype, integer-valued zero points
      perm:    None, or [E, K] int32 (act-order): the packed k-th input of expert e is input
               perm[e, k] of x (each row a permutation of 0..K-1)
    w[e, n, k] = (q[e, n, k] - zeros[e, n, k // group_size]) * scales[e, n, k // group_size]
    in fp32 (multiplying x[perm[e, k]] with a perm). group_size divides K and is a multiple of P
    (a word lies in one group); K is then a multiple of P too. `pack_int_experts` builds one
    from the values, checked."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # shapes only (no device sync): what the kernels index by
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8; got {self.bits}")
        per_word = 32 // self.bits
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 3:
            raise ValueError(f"qweight must be [E, N, K // {per_word}] int32; got "
                             f"{tuple(self.qweight.shape)} {self.qweight.dtype}")
        experts, rows, words = self.qweight.shape
        k = words * per_word
        if self.group_size <= 0 or self.group_size % per_word or k % self.group_size:
            raise ValueError(f"group_size must be a multiple of {per_word} dividing K = {k}; "
                             f"got {self.group_size}")
        groups = (experts, rows, k // self.group_size)
        for name in ("scales", "zeros"):
            t = getattr(self, name)
            if tuple(t.shape) != groups or t.dtype not in (torch.float16, torch.bfloat16,
                                                           torch.float32):
                raise ValueError(f"{name} must be {list(groups)} fp16 / bf16 / fp32; got "
                                 f"{tuple(t.shape)} {t.dtype}")
        if self.zeros.dtype != self.scales.dtype:
            raise ValueError(f"zeros must be in the scales' dtype {self.scales.dtype}; got "
                             f"{self.zeros.dtype}")
        if self.perm is not None and (self.perm.dtype != torch.int32 or tuple(
                self.perm.shape) != (experts, k) or self.perm.stride(1) != 1):
            raise ValueError(f"perm must be [{experts}, {k}] int32 with a contiguous last dim; "
                             f"got {tuple(self.perm.shape)} {self.perm.dtype}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K): the bf16 weight's shape."""
        experts, rows, words = self.qweight.shape
        return experts, rows, words * (32 // self.bits)

    def dequantize(self, dtype: torch.dtype, experts: slice | int = slice(None)) -> torch.Tensor:
        """The experts' weights [E', N, K] in dtype, inputs in x's order (perm undone):
        computed in fp32, rounded once."""
        if isinstance(experts, int):
            experts = slice(experts, experts + 1)
        words = self.qweight[experts]
        shifts = torch.arange(0, 32, self.bits, dtype=torch.int32, device=words.device)
        q = (words[..., None] >> shifts) & ((1 << self.bits) - 1)          # [E', N, K / P, P]
        q = q.reshape(*words.shape[:2], -1).float()
        groups = torch.arange(q.shape[2], device=q.device) // self.group_size
        zeros = self.zeros[experts].float()[:, :, groups]
        scales = self.scales[experts].float()[:, :, groups]
        w = ((q - zeros) * scales).to(dtype)
        if self.perm is None:
            return w
        # input perm[e, k] of x is packed k: x's order puts packed k at perm[e, k]
        return torch.empty_like(w).scatter_(2, self.perm[experts].long()[:, None, :]
                                            .expand_as(w), w)


def pack_int_experts(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int,
                     group_size: int) -> IntExperts:
    """IntExperts from the values q [E, N, K] (an integer tensor in [0, 2**bits)), integer-valued
    zeros [E, N, K // group_size] (cast to the scales' dtype) and scales of that shape."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8; got {bits}")
    if q.dim() != 3 or q.dtype.is_floating_point or q.dtype.is_complex or q.dtype == torch.bool:
        raise ValueError(f"q must be an [E, N, K] integer tensor; got {tuple(q.shape)} {q.dtype}")
    per_word = 32 // bits
    experts, rows, k = q.shape
    if group_size <= 0 or group_size % per_word or k % group_size:
        raise ValueError(f"group_size must be a multiple of {per_word} dividing K = {k}; got "
                         f"{group_size}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise ValueError(f"q must be in [0, {1 << bits}) for {bits} bits")
    if zeros.is_floating_point() and not torch.equal(zeros, zeros.round()):
        raise ValueError("zeros must be integer-valued")
    # the words in int64 (a value shifted by 24 passes int32's sign bit), wrapped to int32
    words = torch.zeros(experts, rows, k // per_word, dtype=torch.int64, device=q.device)
    for i in range(per_word):
        words |= q[:, :, i::per_word].to(torch.int64) << (i * bits)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return IntExperts(words, scales.contiguous(), zeros.to(scales.dtype).contiguous(), bits,
                      group_size)


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool,
                  out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router over logits [T, E]: softmax in fp32, the top_k probabilities and their
    experts ([T, K] each, in descending order), divided by their sum if renormalize, the
    weights in out_dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr,
                  K_P2: tl.constexpr, E_P2: tl.constexpr, RENORMALIZE: tl.constexpr):
    # Program = a token: softmax over its E logits in fp32, then TOP_K rounds of argmax (ties
    # to the lower expert), each taking its expert out of the next rounds.
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf"))
    logits = logits.to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    left = tl.where(e < E, p, -1.0)
    kk = tl.arange(0, K_P2)
    top = tl.zeros([K_P2], tl.float32)
    ids = tl.zeros([K_P2], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(left, 0)
        top = tl.where(kk == k, tl.max(left, 0), top)
        ids = tl.where(kk == k, best, ids)
        left = tl.where(e == best, -1.0, left)
    if RENORMALIZE:
        top = top / tl.sum(tl.where(kk < TOP_K, top, 0.0), 0)
    tl.store(weights_ptr + t * TOP_K + kk, top.to(weights_ptr.dtype.element_ty),
             mask=kk < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kk, ids.to(ids_ptr.dtype.element_ty), mask=kk < TOP_K)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool,
              out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_route_ref in one launch (weights in out_dtype, ids int64 as torch.topk's)."""
    num_tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts}; got {top_k}")
    weights = torch.empty(num_tokens, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
            K_P2=triton.next_power_of_2(top_k), E_P2=triton.next_power_of_2(experts),
            RENORMALIZE=renormalize, num_warps=4 if experts > 256 else 1)
    return weights, ids


@dataclass(frozen=True)
class GemvTiles:
    block_n: int
    block_k: int
    num_warps: int


# KVFLEET_MOE_GEMV_TOKENS: the most tokens a step sends through the GEMV kernels (use_gemv)
_GEMV_TOKENS = (int(os.environ["KVFLEET_MOE_GEMV_TOKENS"])
                if os.environ.get("KVFLEET_MOE_GEMV_TOKENS") else None)


def use_gemv(tokens: int, top_k: int, experts: int, device: torch.device) -> bool:
    """Whether a step of this many tokens takes the GEMV kernels: while its (token, k) pairs
    are at most half the experts, so that few share an expert (an H100 sweep: Qwen3-30B-A3B's
    128 experts, top 8: GEMV 178 vs grouped 184 us at 8 tokens, 294 vs 278 at 16; Mixtral's 8,
    top 2: 240 vs 261 at 1 token, even at 2, 705 vs 667 at 4). KVFLEET_MOE_GEMV_TOKENS: the
    most tokens instead."""
    if _GEMV_TOKENS is not None:
        return tokens <= _GEMV_TOKENS
    return 2 * tokens * top_k <= experts if device.type == "cuda" else tokens <= 4



def gemv_tiles(tokens: int, device: torch.device, bits: int = 0
               ) -> tuple[GemvTiles, GemvTiles]:
    """The GEMV kernels' (up, down) tiles; bits: the IntExperts' (0: bf16 / fp16 / FP8
    experts). On the GPU from `tests/kernels/bench_moe.py --sweep` on an H100
    (docs/PERFORMANCE.md, thirty-ninth session): one layer of Qwen3-30B-A3B's experts at batch 1
    37.5 us with these, 43.5 with 16 x 256 / 8 x 256 tiles. Integer experts, tiles in words
    (64 a row up, 128 or 32 down), from the forty-third session's int4 sweep on an H100:
    Qwen3-30B-A3B's layer at 1 / 2 / 8 tokens 36.2 / 59.1 / 196.5 us against 39.7 / 65.3 /
    218.9 with the first guess (16 x 32 / 8 x 64 words), Mixtral's at 1 token 228.5 against
    260.0. The interpreter runs each program in Python, so few wide ones there."""
    if device.type != "cuda":
        return GemvTiles(64, 128, 4), GemvTiles(64, 128, 4)
    if bits:
        per_word = 32 // bits
        return GemvTiles(8, 64 * per_word, 4), (GemvTiles(8, 128 * per_word, 4) if tokens <= 2
                                                 else GemvTiles(16, 32 * per_word, 4))
    return GemvTiles(16, 512, 4), GemvTiles(4, 512, 8) if tokens <= 2 else GemvTiles(16, 128, 8)


@triton.jit
def _half_to_float(h, BF16: tl.constexpr):
    # h: int32 holding a 16-bit float's bits in its low half (the high half zero) -> fp32
    if BF16:
        return (h << 16).to(tl.float32, bitcast=True)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int_words_dot(w_rows, s_rows, z_rows, v_row, k0, K, group_size, n_valid,
                   BITS: tl.constexpr, BLOCK_K: tl.constexpr, ONE_GROUP: tl.constexpr,
                   EVEN_K: tl.constexpr, V_QUADS: tl.constexpr = False):
    # IntExperts rows (pointers [BLOCK_N, 1] to each row's first word, scale and zero) times
    # the vector v (v_row: its first element) at k0 .. k0 + BLOCK_K, word by word: the
    # [BLOCK_N, BLOCK_K / P] fp32 sums scale * sum_i v[k_i] * (q_i - zero) over each word's
    # P values (w4a16's _word_rows_dot: no reshape of the values, P strided loads of v).
    # ONE_GROUP: the tile lies in one group (a scale and zero a row), else a word's group is
    # looked up (a word lies in one group). EVEN_K: K % BLOCK_K == 0, the rows' words masked
    # by row only (16-byte loads where a thread's words are 4 in a row). V_QUADS: v is fp16 /
    # bf16 with its row 8-byte aligned, read as int64 quads (a word's values in P / 4 loads
    # instead of P) and split in registers.
    PER_WORD: tl.constexpr = 32 // BITS
    kw = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    if EVEN_K:
        kw_valid = kw >= 0
        mask = n_valid[:, None]
    else:
        kw_valid = kw < K // PER_WORD
        mask = n_valid[:, None] & kw_valid[None, :]
    words = tl.load(w_rows + kw[None, :], mask=mask, other=0)
    if ONE_GROUP:
        group = k0 // group_size
        s = tl.load(s_rows + group, mask=n_valid[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_rows + group, mask=n_valid[:, None], other=0.0).to(tl.float32)
    else:
        group = (kw * PER_WORD // group_size)[None, :]
        s = tl.load(s_rows + group, mask=n_valid[:, None] & kw_valid[None, :],
                    other=0.0).to(tl.float32)
        z = tl.load(z_rows + group, mask=n_valid[:, None] & kw_valid[None, :],
                    other=0.0).to(tl.float32)
    part = tl.zeros(words.shape, tl.float32)
    if V_QUADS:
        BF16: tl.constexpr = v_row.dtype.element_ty == tl.bfloat16
        v64 = v_row.to(tl.pointer_type(tl.int64), bitcast=True)
        for j in tl.static_range(PER_WORD // 4):
            quad = tl.load(v64 + kw * (PER_WORD // 4) + j, mask=kw_valid, other=0)
            for h in tl.static_range(2):
                pair = (quad >> (32 * h)).to(tl.int32)
                for t in tl.static_range(2):
                    v = _half_to_float((pair >> (16 * t)) & 0xFFFF, BF16)
                    q = _small_int_to_float((words >> ((4 * j + 2 * h + t) * BITS))
                                            & ((1 << BITS) - 1))
                    part += v[None, :] * (q - z)
    else:
        for i in tl.static_range(PER_WORD):
            v = tl.load(v_row + kw * PER_WORD + i, mask=kw_valid, other=0.0).to(tl.float32)
            q = _small_int_to_float((words >> (i * BITS)) & ((1 << BITS) - 1))
            part += v[None, :] * (q - z)
    return part * s


@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, scale_ptr, zero_ptr, INTER, H, group_size,
                   stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
                   TOP_K: tl.constexpr, W_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BITS: tl.constexpr = 0,
                   ONE_GROUP: tl.constexpr = False, EVEN_K: tl.constexpr = False,
                   V_QUADS: tl.constexpr = False):
    # Program = ((token, k) pair, BLOCK_N columns of SiLU(gate) * up): the gate and up rows
    # of the pair's expert times its token's x, rounded to act's dtype as the grouped path
    # stores them, then silu_mul as silu_and_mul computes it. BITS (4, 8): w is IntExperts'
    # words (strides in words), scale_ptr / zero_ptr its groups' scales and zeros (strides
    # stride_se, stride_sn), dotted word by word in fp32 (_int_words_dot; ONE_GROUP, EVEN_K,
    # V_QUADS: its flags); 0: w in x's dtype or e4m3. TOP_K: the pairs a row of x serves
    # (1 where each pair has its own row: act-order experts' gathered inputs).
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < INTER
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    gate_rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    if BITS == 0:
        acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_valid = k < H
            x = tl.load(x_row + k, mask=k_valid, other=0.0).to(tl.float32)[None, :]
            mask = n_valid[:, None] & k_valid[None, :]
            acc_gate += tl.load(gate_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * x
            acc_up += tl.load(up_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * x
    else:
        BLOCK_KW: tl.constexpr = BLOCK_K * BITS // 32
        gate_s = expert * stride_se + n[:, None].to(tl.int64) * stride_sn     # groups' rows
        up_s = gate_s + INTER * stride_sn
        acc_gate = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            acc_gate += _int_words_dot(gate_rows, scale_ptr + gate_s, zero_ptr + gate_s, x_row,
                                       k0, H, group_size, n_valid, BITS, BLOCK_K, ONE_GROUP,
                                       EVEN_K, V_QUADS)
            acc_up += _int_words_dot(up_rows, scale_ptr + up_s, zero_ptr + up_s, x_row, k0, H,
                                     group_size, n_valid, BITS, BLOCK_K, ONE_GROUP, EVEN_K,
                                     V_QUADS)
    gate = tl.sum(acc_gate, 1)
    up = tl.sum(acc_up, 1)
    if W_SCALE:
        scales = scale_ptr + expert * 2 * INTER + n
        gate *= tl.load(scales, mask=n_valid, other=0.0)
        up *= tl.load(scales + INTER, mask=n_valid, other=0.0)
    dtype = act_ptr.dtype.element_ty
    act = silu_mul(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + n, act, mask=n_valid)


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, scale_ptr, zero_ptr, H,
                     INTER, group_size, stride_am, stride_we, stride_wn, stride_se, stride_sn,
                     stride_om, TOP_K: tl.constexpr, W_SCALE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr = 0,
                     ONE_GROUP: tl.constexpr = False, EVEN_K: tl.constexpr = False,
                     V_QUADS: tl.constexpr = False):
    # Program = (token, BLOCK_N outputs): the sum over its TOP_K pairs of the pair's weight
    # times its expert's w2 rows times the pair's activation, in fp32, cast once. BITS: as
    # _moe_up_kernel's.
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < H
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn
        act_row = act_ptr + pair.to(tl.int64) * stride_am
        if BITS == 0:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_valid = k < INTER
                a = tl.load(act_row + k, mask=k_valid, other=0.0).to(tl.float32)
                w = tl.load(rows + k[None, :], mask=n_valid[:, None] & k_valid[None, :],
                            other=0.0)
                acc += w.to(tl.float32) * a[None, :]
        else:
            s = expert * stride_se + n[:, None].to(tl.int64) * stride_sn
            acc = tl.zeros([BLOCK_N, BLOCK_K * BITS // 32], tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                acc += _int_words_dot(rows, scale_ptr + s, zero_ptr + s, act_row, k0, INTER,
                                      group_size, n_valid, BITS, BLOCK_K, ONE_GROUP, EVEN_K,
                                      V_QUADS)
        part = tl.sum(acc, 1)
        if W_SCALE:
            part *= tl.load(scale_ptr + expert * H + n, mask=n_valid, other=0.0)
        total += part * tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + n,
             total.to(out_ptr.dtype.element_ty), mask=n_valid)


def _perm(w: torch.Tensor | IntExperts) -> torch.Tensor | None:
    """An act-order IntExperts' input permutation, else None."""
    return w.perm if isinstance(w, IntExperts) else None


@triton.jit
def _gather_pairs_kernel(v_ptr, perm_ptr, ids_ptr, out_ptr, K, stride_v, stride_o,
                         PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    # Program = (pair, BLOCK inputs): out[pair, k] = v[pair // PER_ROW, perm[ids[pair], k]]
    pair = tl.program_id(0)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = k < K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    cols = tl.load(perm_ptr + expert * K + k, mask=valid, other=0)
    row = v_ptr + (pair // PER_ROW).to(tl.int64) * stride_v
    tl.store(out_ptr + pair.to(tl.int64) * stride_o + k, tl.load(row + cols, mask=valid),
             mask=valid)


def _gather_inputs(v: torch.Tensor, w: torch.Tensor | IntExperts, ids: torch.Tensor,
                   per_pair: int) -> tuple[torch.Tensor, int]:
    """A projection's input rows and how many (token, k) pairs share a row: v's rows (pair p
    reads row p // per_pair) as they are, or, for act-order experts, each pair's row gathered
    through its expert's perm (one launch; a row a pair: 1)."""
    perm = _perm(w)
    if perm is None:
        return v, per_pair
    pairs, k = ids.numel(), v.shape[1]
    out = torch.empty(pairs, k, dtype=v.dtype, device=v.device)
    if pairs:
        block = min(1024, triton.next_power_of_2(k))
        _gather_pairs_kernel[(pairs, triton.cdiv(k, block))](
            v, perm, ids.reshape(-1), out, k, v.stride(0), out.stride(0), PER_ROW=per_pair,
            BLOCK=block)
    return out, 1


def _weight_args(w: torch.Tensor | IntExperts, scale: torch.Tensor | None, block_k: int,
                 dummy: torch.Tensor) -> tuple:
    """A kernel's weight arguments: (w, scale_ptr, zero_ptr, group_size, stride_we, stride_wn,
    stride_se, stride_sn, BITS, GROUP_K); dummy stands for the pointers a path does not read."""
    if not isinstance(w, IntExperts):
        return (w, scale if scale is not None else dummy, dummy, 0, w.stride(0), w.stride(1),
                0, 0, 0, 1)
    per_word = 32 // w.bits
    if block_k % per_word:
        raise ValueError(f"BLOCK_K must be a multiple of {per_word} for {w.bits}-bit experts; "
                         f"got {block_k}")
    if w.qweight.stride(2) != 1 or w.scales.stride(2) != 1 or w.zeros.stride() != w.scales.stride():
        raise ValueError("IntExperts' tensors need a contiguous last dim and zeros strided as "
                         "the scales")
    # GROUP_K: the runs of k in one group a tile splits into (block_k a power of two)
    return (w.qweight, w.scales, w.zeros, w.group_size, w.qweight.stride(0), w.qweight.stride(1),
            w.scales.stride(0), w.scales.stride(1), w.bits, math.gcd(w.group_size, block_k))


# KVFLEET_MOE_V_QUADS=0: the int experts' GEMV loads its input a value at a time (_quads)
_V_QUADS = os.environ.get("KVFLEET_MOE_V_QUADS", "1") != "0"


def _quads(v: torch.Tensor) -> bool:
    """Whether the int experts' GEMV reads v's rows (fp16 / bf16) as int64 quads: each row
    8-byte aligned."""
    return (_V_QUADS and v.dtype in (torch.float16, torch.bfloat16) and v.data_ptr() % 8 == 0
            and v.stride(0) % 4 == 0)


def _fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor | IntExperts,
                    w2: torch.Tensor | IntExperts, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, w13_scale: torch.Tensor | None,
                    w2_scale: torch.Tensor | None,
                    tiles: tuple[GemvTiles, GemvTiles] | None = None) -> torch.Tensor:
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    bits = w13.bits if isinstance(w13, IntExperts) else 0
    up, down = tiles or gemv_tiles(num_tokens, x.device, bits)
    ids = topk_ids.contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    w, s, z, group, we, wn, se, sn, bits, group_k = _weight_args(w13, w13_scale, up.block_k, act)
    x, per_row = _gather_inputs(x, w13, ids, top_k)
    _moe_up_kernel[(num_tokens * top_k, triton.cdiv(inter, up.block_n))](
        x, w, ids, act, s, z, inter, hidden, group, x.stride(0), we, wn, se, sn, act.stride(0),
        TOP_K=per_row, W_SCALE=w13_scale is not None, BLOCK_N=up.block_n, BLOCK_K=up.block_k,
        BITS=bits, ONE_GROUP=group_k == up.block_k, EVEN_K=hidden % up.block_k == 0,
        V_QUADS=bits != 0 and _quads(x), num_warps=up.num_warps)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    w, s, z, group, we, wn, se, sn, bits, group_k = _weight_args(w2, w2_scale, down.block_k, act)
    act, _ = _gather_inputs(act, w2, ids, 1)
    _moe_down_kernel[(num_tokens, triton.cdiv(hidden, down.block_n))](
        act, w, ids, topk_weights.contiguous(), out, s, z, hidden, inter, group, act.stride(0),
        we, wn, se, sn, out.stride(0), TOP_K=top_k, W_SCALE=w2_scale is not None,
        BLOCK_N=down.block_n, BLOCK_K=down.block_k, BITS=bits, ONE_GROUP=group_k == down.block_k,
        EVEN_K=inter % down.block_k == 0, V_QUADS=bits != 0 and _quads(act),
        num_warps=down.num_warps)
    return out


def _expert_weight(w: torch.Tensor | IntExperts, scale: torch.Tensor | None, e: int,
                   dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, IntExperts):
        if scale is not None:
            raise ValueError("integer experts take no FP8 scales")
        return w.dequantize(dtype, slice(e, e + 1))[0]
    return dequantize_experts(w[e:e + 1], None if scale is None else scale[e:e + 1], dtype)[0]


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor | IntExperts, w2: torch.Tensor | IntExperts,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H]: HF's expert loop (the experts hit, their tokens gathered, each output
    times its weight added into a zeroed output in x's dtype). With scales, w13 / w2 are e4m3
    with a scale a row (fused_moe's FP8 experts); IntExperts: int4 / int8 groups. Either is
    dequantized expert by expert to x's dtype."""
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        token, pos = (topk_ids == e).nonzero(as_tuple=True)
        up_w = _expert_weight(w13, w13_scale, e, x.dtype)
        down_w = _expert_weight(w2, w2_scale, e, x.dtype)
        gate, up = torch.nn.functional.linear(x[token], up_w).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_w)
        out.index_add_(0, token, (h * topk_weights[token, pos, None]).to(x.dtype))
    return out


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs (index token * K + k) grouped by expert, each expert's run padded up
    to a multiple of block_m with the index K * T (no pair), and each block's expert
    (num_experts from the padded total on). Shapes depend on T, K and num_experts only:
    sorted_pairs [T * K + E * (block_m - 1)] int32, block_experts [cdiv(that, block_m)] int32."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)             # pairs by expert, in pair order
    experts = flat[order]
    rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[experts]
    size = pairs + num_experts * (block_m - 1)
    sorted_pairs = torch.full((size,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs[(ends - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=dev)
    block_experts = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


@triton.jit
def _align_count_kernel(ids_ptr, table_ptr, num_pairs, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    # Program = a chunk of CHUNK pairs: its pairs an expert, into table[chunk, :]
    chunk = tl.program_id(0)
    p = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
    e = tl.arange(0, E_P2)
    tl.store(table_ptr + chunk * E_P2 + e, tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0))


@triton.jit
def _align_place_kernel(ids_ptr, table_ptr, sorted_ptr, block_experts_ptr, num_pairs,
                        num_chunks, size, num_blocks, NUM_EXPERTS: tl.constexpr,
                        E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                        ROWS: tl.constexpr, FILL: tl.constexpr):
    # Program = a chunk again: the experts' counts (every chunk's row summed) give the padded
    # runs' starts; a pair's slot is its expert's start + that expert's pairs in earlier chunks
    # + those before it in its chunk (a one-hot [CHUNK, E] cumsum), so each expert's pairs
    # stay in pair order. Program 0 also writes each block's expert (NUM_EXPERTS past the
    # padded total), the runs' padding slots and the slots past the total (num_pairs: no pair).
    chunk = tl.program_id(0)
    e = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], tl.int32)
    before = tl.zeros([E_P2], tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        rows = tl.load(table_ptr + r[:, None] * E_P2 + e[None, :],
                       mask=(r < num_chunks)[:, None], other=0)
        counts += tl.sum(rows, 0)
        before += tl.sum(tl.where((r < chunk)[:, None], rows, 0), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    c = tl.arange(0, CHUNK)
    p = chunk * CHUNK + c
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)
    rank = tl.sum((tl.cumsum(onehot, 0) - onehot) * onehot, 1)
    slot = tl.sum(onehot * (starts + before)[None, :], 1) + rank
    tl.store(sorted_ptr + slot, p, mask=p < num_pairs)
    if chunk == 0:
        for b0 in range(0, num_blocks, CHUNK):       # the experts whose run ends by the block
            b = b0 + c
            expert = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1)
            tl.store(block_experts_ptr + b, tl.minimum(expert, NUM_EXPERTS),
                     mask=b < num_blocks)
        j = tl.arange(0, BLOCK_M)
        pad = (starts + counts)[:, None] + j[None, :]
        tl.store(sorted_ptr + pad, num_pairs,
                 mask=(e < NUM_EXPERTS)[:, None] & (pad < ends[:, None]))
        f = tl.arange(0, FILL)
        for s0 in range(tl.sum(padded, 0), size, FILL):
            tl.store(sorted_ptr + s0 + f, num_pairs, mask=s0 + f < size)


def _align_chunk(experts: int) -> int:
    # pairs a chunk: a one-hot [chunk, E] of at most 8192 entries
    return max(16, min(256, 8192 // triton.next_power_of_2(experts)))


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's result, slot for slot, in two launches of a program a chunk of pairs."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    size = pairs + num_experts * (block_m - 1)
    dev = flat.device
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=dev)
    block_experts = torch.empty(triton.cdiv(size, block_m), dtype=torch.int32, device=dev)
    e_p2 = triton.next_power_of_2(num_experts)
    chunk = _align_chunk(num_experts)
    chunks = max(1, triton.cdiv(pairs, chunk))
    table = torch.empty(chunks, e_p2, dtype=torch.int32, device=dev)
    _align_count_kernel[(chunks,)](flat, table, pairs, E_P2=e_p2, CHUNK=chunk, num_warps=4)
    _align_place_kernel[(chunks,)](
        flat, table, sorted_pairs, block_experts, pairs, chunks, size, block_experts.numel(),
        NUM_EXPERTS=num_experts, E_P2=e_p2, BLOCK_M=block_m, CHUNK=chunk,
        ROWS=max(1, min(triton.next_power_of_2(chunks), 8192 // e_p2)), FILL=1024, num_warps=4)
    return sorted_pairs, block_experts


def use_align_kernel(pairs: int, experts: int) -> bool:
    """Whether moe_align_triton groups this many (token, k) pairs (else moe_align's torch ops):
    while they fill at most 256 chunks (each chunk's program reads every chunk's counts)."""
    return triton.cdiv(pairs, _align_chunk(experts)) <= 256


@triton.jit
def _int_tile(w_base, scale_ptr, zero_ptr, expert, n, n_valid, k0, K, group_size, stride_wn,
              stride_se, stride_sn, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_K: tl.constexpr):
    # The grouped GEMM's [BLOCK_K, BLOCK_N] fp32 tile of IntExperts at k0, (q - zero) * scale:
    # words [BLOCK_K / P, BLOCK_N] split along K by w4a16's _split_words. GROUP_K (a power of
    # two dividing BLOCK_K and group_size) consecutive k share a group: BLOCK_K / GROUP_K
    # scales and zeros a column, one when a group spans the tile.
    PER_WORD: tl.constexpr = 32 // BITS
    kw = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    words = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + kw[:, None],
                    mask=n_valid[None, :] & (kw < K // PER_WORD)[:, None], other=0)
    q = _small_int_to_float(_split_words(words, BITS))                          # [K, N]
    cols = expert.to(tl.int64) * stride_se + n[None, :].to(tl.int64) * stride_sn
    if GROUP_K == BLOCK_K:                    # the tile in one group
        group = k0 // group_size
        s = tl.load(scale_ptr + cols + group, mask=n_valid[None, :], other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + cols + group, mask=n_valid[None, :], other=0.0).to(tl.float32)
        w = (q - z) * s
    else:
        kg = k0 + tl.arange(0, BLOCK_K // GROUP_K) * GROUP_K       # each run's first k
        mask = n_valid[None, :] & (kg < K)[:, None]
        group = (kg // group_size)[:, None]
        s = tl.load(scale_ptr + cols + group, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + cols + group, mask=mask, other=0.0).to(tl.float32)
        q = tl.reshape(q, (BLOCK_K // GROUP_K, GROUP_K, n.shape[0]))
        w = tl.reshape((q - z[:, None, :]) * s[:, None, :], (BLOCK_K, n.shape[0]))
    return w


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
                     scale_ptr, zero_ptr, num_pairs, N, K, group_size, stride_am, stride_we,
                     stride_wn, stride_se, stride_sn, stride_om, A_DIV: tl.constexpr,
                     MUL_WEIGHT: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     W_SCALE: tl.constexpr = False, BITS: tl.constexpr = 0,
                     GROUP_K: tl.constexpr = 1):
    # Program = (block of BLOCK_M sorted pairs, all of one expert; BLOCK_N outputs):
    # out[pair, n] = sum_k a[pair // A_DIV, k] * w[expert, n, k] (times the pair's weight).
    # W_SCALE: w is e4m3, read in a's dtype, each output column times scale[expert, n].
    # BITS (4, 8): w is IntExperts' words; the [BLOCK_K, BLOCK_N] tile comes from
    # [BLOCK_K / P, BLOCK_N] words split along K, (q - zero) * scale in fp32 (GROUP_K: as
    # _int_tile's), rounded to a's dtype as fused_moe_ref's dequantized weight.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= NUM_EXPERTS:      # past the padded total: no pairs
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // A_DIV).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :],
                    mask=valid[:, None] & k_valid[None, :], other=0.0)
        if BITS == 0:
            w = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + k[:, None],
                        mask=n_valid[None, :] & k_valid[:, None], other=0.0)       # [K, N]
            if W_SCALE:
                w = w.to(a.dtype)
        else:
            w = _int_tile(w_base, scale_ptr, zero_ptr, expert, n, n_valid, k0, K, group_size,
                          stride_wn, stride_se, stride_sn, BITS, BLOCK_K, GROUP_K).to(a.dtype)
        acc += tl.dot(a, w, input_precision="ieee")
    if W_SCALE:
        acc *= tl.load(scale_ptr + expert.to(tl.int64) * N + n, mask=n_valid, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_valid[None, :])


@dataclass(frozen=True)
class GroupedTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def grouped_tiles(pairs: int, experts: int, device: torch.device) -> GroupedTiles:
    """The grouped GEMM's tiles for this many (token, k) pairs over this many experts: rows a
    block as the pairs an expert has (an H100 sweep, bench_moe.py, Qwen3-30B-A3B's experts:
    64 tokens 447 us, 256 tokens 575, 1024 tokens 708, 4096 tokens 1461, against 467 / 577 /
    718 / 1908 with 16 or 64 x 64 x 64 tiles; Mixtral's 256 tokens 1092 against 1873)."""
    if device.type != "cuda":
        return GroupedTiles(16, 32, 32, 4, 1)
    per_expert = pairs / experts
    if per_expert <= 8:
        return GroupedTiles(16, 64, 128, 4, 3)
    if per_expert <= 24:
        return GroupedTiles(32, 64, 128, 4, 3)
    return GroupedTiles(64, 128, 64, 4, 3)


def _gemm(a: torch.Tensor, w: torch.Tensor | IntExperts, out: torch.Tensor,
          sorted_pairs: torch.Tensor, block_experts: torch.Tensor, weights: torch.Tensor | None,
          a_div: int, tiles: GroupedTiles, scale: torch.Tensor | None = None) -> None:
    num_pairs, n = out.shape
    k = w.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, tiles.block_n))
    wt, s, z, group, we, wn, se, sn, bits, group_k = _weight_args(w, scale, tiles.block_k, out)
    _moe_gemm_kernel[grid](
        a, wt, out, sorted_pairs, block_experts, weights if weights is not None else out,
        s, z, num_pairs, n, k, group, a.stride(0), we, wn, se, sn, out.stride(0),
        A_DIV=a_div, MUL_WEIGHT=weights is not None, NUM_EXPERTS=w.shape[0],
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        W_SCALE=scale is not None, BITS=bits, GROUP_K=group_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor | IntExperts, w2: torch.Tensor | IntExperts,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              gemv: bool | None = None,
              tiles: GroupedTiles | tuple[GemvTiles, GemvTiles] | None = None) -> torch.Tensor:
    """Triton twin of fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (each with a
    contiguous last dim), topk_weights / topk_ids [T, K] -> [T, H] in x's dtype. The pairs'
    outputs are summed over k in fp32. FP8 experts: w13 / w2 e4m3 with fp32 scales [E, 2I] /
    [E, H] (W8A16: read in x's dtype, each output column scaled). Integer experts: w13 and w2
    both IntExperts (int4 / int8 groups, dequantized in registers; no FP8 scales).
    gemv: the GEMV kernels (True) or the grouped GEMM (False); None: as use_gemv says.
    tiles: the path's tiles in place of the tuned ones (bench_moe.py's sweep)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if isinstance(w13, IntExperts) != isinstance(w2, IntExperts):
        raise ValueError("w13 and w2 must both be IntExperts or neither; got "
                         f"{type(w13).__name__} and {type(w2).__name__}")
    if isinstance(w13, IntExperts) and (w13_scale is not None or w2_scale is not None):
        raise ValueError("integer experts take no FP8 scales")
    if w13.shape[2] != hidden or tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w13 must be [E, 2I, {hidden}] and w2 [E, {hidden}, I]; got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    if num_tokens == 0:
        return torch.empty_like(x)
    if gemv if gemv is not None else use_gemv(num_tokens, top_k, num_experts, x.device):
        return _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, tiles)
    pairs = num_tokens * top_k
    tiles = tiles or grouped_tiles(pairs, num_experts, x.device)
    align = moe_align_triton if use_align_kernel(pairs, num_experts) else moe_align
    sorted_pairs, block_experts = align(topk_ids, num_experts, tiles.block_m)
    inter = torch.empty(pairs, two_inter, dtype=x.dtype, device=x.device)
    a, per_row = _gather_inputs(x, w13, topk_ids, top_k)
    _gemm(a, w13, inter, sorted_pairs, block_experts, None, per_row, tiles, w13_scale)
    act, _ = _gather_inputs(silu_and_mul(inter), w2, topk_ids, 1)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _gemm(act, w2, out, sorted_pairs, block_experts, topk_weights.reshape(-1).contiguous(), 1,
          tiles, w2_scale)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
