"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): torch reference and a Triton grouped GEMM.

Each token picks top_k experts (topk_ids [T, K], weights topk_weights [T, K]); expert e is a
gated MLP: w13[e] = [gate | up] ([2I, H]), w2[e] ([H, I]). The output of a token is the sum of
its experts' outputs, each times its weight.

The Triton path runs every expert in two launches of one grouped GEMM (vLLM's fused_moe
design): the (token, k) pairs sorted by expert, each expert's run padded to BLOCK_M rows
(`moe_align`), a program a block of BLOCK_M pairs of one expert x BLOCK_N outputs, gathering its
rows of the input. `moe_align` runs on the device with shapes fixed by T, K and the expert
count (no host sync), so the decode graphs capture it; blocks past the padded total exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                       ) -> torch.Tensor:
    """Stacked expert weights [E, N, K], e4m3 with per-(expert, row) scales [E, N], in dtype."""
    return w if scale is None else (w.float() * scale[:, :, None]).to(dtype)


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


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
          block_experts: torch.Tensor, weights: torch.Tensor | None, a_div: int,
          block_m: int, scale: torch.Tensor | None = None) -> None:
    num_pairs, n = out.shape
    k = w.shape[2]
    on_gpu = a.is_cuda
    block_n, block_k = (64, 64) if on_gpu else (32, 32)
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_experts, weights if weights is not None else out,
        scale if scale is not None else out,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_DIV=a_div, MUL_WEIGHT=weights is not None, NUM_EXPERTS=w.shape[0], BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, W_SCALE=scale is not None, num_warps=4,
        num_stages=3 if on_gpu else 1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int | None = None,
              w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (each with a
    contiguous last dim), topk_weights / topk_ids [T, K] -> [T, H] in x's dtype. The pairs'
    outputs are summed over k in fp32. FP8 experts: w13 / w2 e4m3 with fp32 scales [E, 2I] /
    [E, H] (W8A16: read in x's dtype, each output column scaled)."""
    from kvfleet_kernels.activation import silu_and_mul
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w13 must be [E, 2I, {hidden}] and w2 [E, {hidden}, I]; got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    if num_tokens == 0:
        return torch.empty_like(x)
    block_m = block_m or (64 if x.is_cuda and num_tokens * top_k >= 1024 else 16)
    sorted_pairs, block_experts = moe_align(topk_ids, num_experts, block_m)
    pairs = num_tokens * top_k
    inter = torch.empty(pairs, two_inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, inter, sorted_pairs, block_experts, None, top_k, block_m, w13_scale)
    act = silu_and_mul(inter)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _gemm(act, w2, out, sorted_pairs, block_experts, topk_weights.reshape(-1).contiguous(), 1,
          block_m, w2_scale)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
