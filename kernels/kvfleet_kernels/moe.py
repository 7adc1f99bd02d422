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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet_kernels.activation import silu_and_mul, silu_mul


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                       ) -> torch.Tensor:
    """Stacked expert weights [E, N, K], e4m3 with per-(expert, row) scales [E, N], in dtype."""
    return w if scale is None else (w.float() * scale[:, :, None]).to(dtype)


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



def gemv_tiles(tokens: int, device: torch.device) -> tuple[GemvTiles, GemvTiles]:
    """The GEMV kernels' (up, down) tiles. On the GPU from `tests/kernels/bench_moe.py --sweep`
    on an H100 (docs/PERFORMANCE.md, thirty-ninth session): one layer of Qwen3-30B-A3B's experts
    at batch 1 37.5 us with these, 43.5 with 16 x 256 / 8 x 256 tiles. The interpreter runs each
    program in Python, so few wide ones there."""
    if device.type != "cuda":
        return GemvTiles(64, 128, 4), GemvTiles(64, 128, 4)
    return GemvTiles(16, 512, 4), GemvTiles(4, 512, 8) if tokens <= 2 else GemvTiles(16, 128, 8)


@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, scale_ptr, INTER, H, stride_xm, stride_we,
                   stride_wn, stride_am, TOP_K: tl.constexpr, W_SCALE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program = ((token, k) pair, BLOCK_N columns of SiLU(gate) * up): the gate and up rows
    # of the pair's expert times its token's x, rounded to act's dtype as the grouped path
    # stores them, then silu_mul as silu_and_mul computes it.
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < INTER
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    gate_rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < H
        x = tl.load(x_row + k, mask=k_valid, other=0.0).to(tl.float32)[None, :]
        mask = n_valid[:, None] & k_valid[None, :]
        acc_gate += tl.load(gate_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * x
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
def _moe_down_kernel(act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, scale_ptr, H, INTER,
                     stride_am, stride_we, stride_wn, stride_om, TOP_K: tl.constexpr,
                     W_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program = (token, BLOCK_N outputs): the sum over its TOP_K pairs of the pair's weight
    # times its expert's w2 rows times the pair's activation, in fp32, cast once.
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
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_valid = k < INTER
            a = tl.load(act_row + k, mask=k_valid, other=0.0).to(tl.float32)
            w = tl.load(rows + k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
        part = tl.sum(acc, 1)
        if W_SCALE:
            part *= tl.load(scale_ptr + expert * H + n, mask=n_valid, other=0.0)
        total += part * tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + n,
             total.to(out_ptr.dtype.element_ty), mask=n_valid)


def _fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                    tiles: tuple[GemvTiles, GemvTiles] | None = None) -> torch.Tensor:
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    up, down = tiles or gemv_tiles(num_tokens, x.device)
    ids = topk_ids.contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _moe_up_kernel[(num_tokens * top_k, triton.cdiv(inter, up.block_n))](
        x, w13, ids, act, w13_scale if w13_scale is not None else act, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), TOP_K=top_k,
        W_SCALE=w13_scale is not None, BLOCK_N=up.block_n, BLOCK_K=up.block_k,
        num_warps=up.num_warps)
    out = torch.empty_like(x)
    _moe_down_kernel[(num_tokens, triton.cdiv(hidden, down.block_n))](
        act, w2, ids, topk_weights.contiguous(), out, w2_scale if w2_scale is not None else act,
        hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), TOP_K=top_k,
        W_SCALE=w2_scale is not None, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        num_warps=down.num_warps)
    return out


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H]: HF's expert loop (the experts hit, their tokens gathered, each output
    times its weight added into a zeroed output in x's dtype). With scales, w13 / w2 are e4m3
    with a scale a row (fused_moe's FP8 experts), dequantized expert by expert."""
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        token, pos = (topk_ids == e).nonzero(as_tuple=True)
        up_w = dequantize_experts(w13[e:e + 1], None if w13_scale is None else w13_scale[e:e + 1],
                                  x.dtype)[0]
        down_w = dequantize_experts(w2[e:e + 1], None if w2_scale is None else w2_scale[e:e + 1],
                                    x.dtype)[0]
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
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
                     scale_ptr, num_pairs, N, K, stride_am, stride_we, stride_wn, stride_om,
                     A_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     W_SCALE: tl.constexpr = False):
    # Program = (block of BLOCK_M sorted pairs, all of one expert; BLOCK_N outputs):
    # out[pair, n] = sum_k a[pair // A_DIV, k] * w[expert, n, k] (times the pair's weight).
    # W_SCALE: w is e4m3, read in a's dtype, each output column times scale[expert, n].
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
        w = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=n_valid[None, :] & k_valid[:, None], other=0.0)           # [K, N]
        if W_SCALE:
            w = w.to(a.dtype)
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


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
          block_experts: torch.Tensor, weights: torch.Tensor | None, a_div: int,
          tiles: GroupedTiles, scale: torch.Tensor | None = None) -> None:
    num_pairs, n = out.shape
    k = w.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, tiles.block_n))
    _moe_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_experts, weights if weights is not None else out,
        scale if scale is not None else out,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_DIV=a_div, MUL_WEIGHT=weights is not None, NUM_EXPERTS=w.shape[0],
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        W_SCALE=scale is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, gemv: bool | None = None,
              tiles: GroupedTiles | tuple[GemvTiles, GemvTiles] | None = None) -> torch.Tensor:
    """Triton twin of fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (each with a
    contiguous last dim), topk_weights / topk_ids [T, K] -> [T, H] in x's dtype. The pairs'
    outputs are summed over k in fp32. FP8 experts: w13 / w2 e4m3 with fp32 scales [E, 2I] /
    [E, H] (W8A16: read in x's dtype, each output column scaled). gemv: the GEMV kernels
    (True) or the grouped GEMM (False); None: as use_gemv says.
    tiles: the path's tiles in place of the tuned ones (bench_moe.py's sweep)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
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
    _gemm(x, w13, inter, sorted_pairs, block_experts, None, top_k, tiles, w13_scale)
    act = silu_and_mul(inter)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _gemm(act, w2, out, sorted_pairs, block_experts, topk_weights.reshape(-1).contiguous(), 1,
          tiles, w2_scale)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
