"""Mixture-of-experts MLP: moe_align's grouping, and fused_moe (Triton) against fused_moe_ref.

CPU cases run in Triton's interpreter (fp32, fp16); the gpu case uses Mixtral-like shapes in bf16.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.moe import (
    fused_moe,
    fused_moe_ref,
    moe_align,
    moe_align_triton,
    moe_route,
    moe_route_ref,
)
from paged_batch import CPU_DTYPES, DEVICE

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
          seed: int, device: str = DEVICE, skew: bool = False):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(device, dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:                 # most tokens on expert 0: runs of several blocks, experts unused
        logits[:, 0] += 4.0
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).to(device), ids.to(device)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"),
                         [(1, 4, 2, 16), (37, 8, 2, 16), (50, 16, 4, 32), (5, 3, 3, 16),
                          (70, 128, 8, 16), (300, 4, 2, 16)])
def test_moe_align_groups_every_pair_once_by_expert(tokens, experts, top_k, block_m) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    sorted_pairs, block_experts = moe_align(ids, experts, block_m)
    pairs = tokens * top_k
    assert sorted_pairs.numel() == pairs + experts * (block_m - 1)
    real = sorted_pairs[sorted_pairs < pairs]
    assert sorted(real.tolist()) == list(range(pairs))          # every pair exactly once
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_experts.tolist()):
        block = sorted_pairs[b * block_m:(b + 1) * block_m]
        block = block[block < pairs]
        if expert >= experts:
            assert block.numel() == 0                            # past the padded total
        else:
            assert (flat[block.long()] == expert).all()          # one expert a block
    # each expert's pairs in pair order, its run starting on a block
    for e in range(experts):
        blocks = [b for b, x in enumerate(block_experts.tolist()) if x == e]
        run = sorted_pairs[blocks[0] * block_m:(blocks[-1] + 1) * block_m] if blocks else []
        got = [p for p in (run.tolist() if blocks else []) if p < pairs]
        assert got == (flat == e).nonzero().flatten().tolist()
    # the one-launch kernel gives the same grouping, slot for slot (pairs over several of its
    # chunks, experts not a power of two)
    triton_pairs, triton_blocks = moe_align_triton(ids.to(DEVICE), experts, block_m)
    assert torch.equal(triton_pairs.cpu(), sorted_pairs)
    assert torch.equal(triton_blocks.cpu(), block_experts)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "skew", "gemv"),
                         [(1, 4, 2, 32, 48, False, False), (23, 8, 2, 64, 40, False, False),
                          (40, 6, 3, 48, 32, True, False), (1, 4, 2, 32, 48, False, True),
                          (9, 6, 3, 80, 72, True, True)])
def test_fused_moe_matches_reference(dtype, tokens, experts, top_k, hidden, inter, skew,
                                     gemv) -> None:
    # gemv: the few-token path (a GEMV a (token, k) pair; hidden and inter past one tile)
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, seed=tokens,
                                     skew=skew)
    out = fused_moe(x, w13, w2, weights, ids, gemv=gemv)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, rtol=0.0, atol=TOLERANCE[dtype] * 4)
    # the weights and the routing matter: another expert choice gives another output
    other = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, (ids + 1) % experts)
    assert (other - ref).abs().max() > 100 * TOLERANCE[dtype]


def _fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from kvfleet_kernels.fp8 import quantize_fp8_rowwise
    q, scale = quantize_fp8_rowwise(w.reshape(-1, w.shape[2]))
    return q.reshape(w.shape), scale.reshape(w.shape[:2]).contiguous()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("tokens", "gemv"), [(29, False), (3, True)])
def test_fp8_experts_match_the_reference_over_their_dequantized_weights(dtype, tokens,
                                                                        gemv) -> None:
    # W8A16: e4m3 weights with a scale a row, read in the activation's dtype
    from kvfleet_kernels.moe import dequantize_experts
    x, w13, w2, weights, ids = _case(tokens, 6, 2, 64, 48, dtype, seed=3)
    (q13, s13), (q2, s2) = _fp8_experts(w13.float()), _fp8_experts(w2.float())
    out = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, gemv=gemv)
    ref = fused_moe_ref(x.float(), dequantize_experts(q13, s13, torch.float32),
                        dequantize_experts(q2, s2, torch.float32), weights, ids)
    torch.testing.assert_close(out.float(), ref, rtol=0.0, atol=TOLERANCE[dtype] * 4)
    # the reference reads the same e4m3 experts itself
    torch.testing.assert_close(fused_moe_ref(x.float(), q13, q2, weights, ids, s13, s2), ref,
                               rtol=0, atol=0)
    # and the scales are applied: without them the output is far off
    unscaled = fused_moe_ref(x.float(), q13.float(), q2.float(), weights, ids)
    assert (unscaled - ref).abs().max() > 1.0


@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize"),
                         [(5, 8, 2, True), (3, 128, 8, True), (4, 60, 4, False), (2, 6, 6, True)])
def test_moe_route_matches_hf_router(tokens, experts, top_k, renormalize) -> None:
    gen = torch.Generator().manual_seed(experts)
    logits = (torch.randn(tokens, experts, generator=gen) * 3).to(DEVICE)
    for dtype in (torch.float32, torch.float16):
        weights, ids = moe_route(logits, top_k, renormalize, dtype)
        ref_weights, ref_ids = moe_route_ref(logits, top_k, renormalize, dtype)
        assert weights.dtype == dtype and ids.dtype == ref_ids.dtype == torch.int64
        assert torch.equal(ids, ref_ids)                       # the same experts, same order
        torch.testing.assert_close(weights, ref_weights, rtol=TOLERANCE[dtype], atol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(tokens, device=DEVICE),
                                   rtol=0, atol=2e-3)
    else:                              # the raw probabilities: they sum below 1 unless K = E
        assert (weights.float().sum(-1) < 0.999).all()
    # ties go to the lower expert, as the experts left after each pick are compared
    tied = torch.zeros(1, experts, device=DEVICE)
    tied[0, 1::2] = 1.0
    _, ids = moe_route(tied, top_k, renormalize)
    assert ids.tolist() == [list(range(1, experts, 2))[:top_k] if top_k <= experts // 2 else
                            list(range(1, experts, 2)) + list(range(0, experts, 2))[
                                :top_k - experts // 2]]
    with pytest.raises(ValueError, match=f"top_k must be in 1..{experts}"):
        moe_route(logits, experts + 1, renormalize)


def test_fused_moe_refuses_mismatched_weights() -> None:
    x, w13, w2, weights, ids = _case(3, 4, 2, 32, 48, torch.float32, seed=1, device="cpu")
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, 32\] and w2 \[E, 32, I\]"):
        fused_moe(x, w13, w2[:, :, :40], weights, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 300, 2048])
def test_gpu_fused_moe_bf16(tokens: int) -> None:
    # Mixtral's routing (8 experts, top 2) at a small hidden size; Qwen3-MoE's 128 / top 8
    for experts, top_k in [(8, 2), (128, 8)]:
        x, w13, w2, weights, ids = _case(tokens, experts, top_k, 1024, 768, torch.bfloat16,
                                         seed=tokens)
        ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        scale = max(float(ref.abs().max()), 1.0)
        (q13, s13), (q2, s2) = _fp8_experts(w13.float()), _fp8_experts(w2.float())
        ref8 = fused_moe_ref(x.float(), q13, q2, weights, ids, s13, s2)
        scale8 = max(float(ref8.abs().max()), 1.0)
        for gemv in ([False, True] if tokens <= 16 else [False]):
            out = fused_moe(x, w13, w2, weights, ids, gemv=gemv)
            torch.testing.assert_close(out.float() / scale, ref / scale, rtol=0.0, atol=2e-2)
            # FP8 experts (W8A16) against the reference over the same e4m3 weights
            out = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, gemv=gemv)
            torch.testing.assert_close(out.float() / scale8, ref8 / scale8, rtol=0.0, atol=2e-2)
    # the router kernel on Qwen3-MoE's 128 experts in bf16 logits
    logits = torch.randn(tokens, 128, device="cuda").to(torch.bfloat16)
    weights, ids = moe_route(logits, 8, True, torch.bfloat16)
    ref_weights, ref_ids = moe_route_ref(logits, 8, True, torch.bfloat16)
    # bf16 logits tie: tied experts may come in another order (and, at the k-th place, be
    # another expert), so compare each token's experts as sorted sets, each with its weight
    ids, order = ids.sort(-1)
    ref_ids, ref_order = ref_ids.sort(-1)
    same = (ids == ref_ids).all(-1)
    assert same.float().mean() > 0.9
    torch.testing.assert_close(weights.gather(-1, order)[same].float(),
                               ref_weights.gather(-1, ref_order)[same].float(), rtol=1e-2,
                               atol=1e-3)
