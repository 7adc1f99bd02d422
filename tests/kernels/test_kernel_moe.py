"""Mixture-of-experts MLP: moe_align's grouping, and fused_moe (Triton) against fused_moe_ref.

CPU cases run in Triton's interpreter (fp32, fp16); the gpu case uses Mixtral-like shapes in bf16,
the int4 one Qwen3-30B-A3B's experts.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.moe import (
    GemvTiles,
    GroupedTiles,
    IntExperts,
    fused_moe,
    fused_moe_ref,
    moe_align,
    moe_align_triton,
    moe_route,
    moe_route_ref,
    pack_int_experts,
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


# -- weight-only int4 / int8 experts (IntExperts) ------------------------------------------

def _int_values(experts: int, rows: int, k: int, bits: int, group_size: int,
                gen: torch.Generator):
    """Random q [E, N, K], integer zeros and fp16 scales [E, N, K / group_size] on gen's device:
    every value and zero point in [0, 2**bits), scales spread 3x so each group's matters; w
    about unit variance / sqrt(K) (outputs of order one)."""
    dev = gen.device
    groups = k // group_size
    q = torch.randint(0, 1 << bits, (experts, rows, k), generator=gen, device=dev,
                      dtype=torch.int32)
    zeros = torch.randint(0, 1 << bits, (experts, rows, groups), generator=gen, device=dev,
                          dtype=torch.int32).half()
    scales = (torch.rand(experts, rows, groups, generator=gen, device=dev) + 0.5) * (
        6.0 / ((1 << bits) * k ** 0.5))
    return q, zeros, scales.half()


def _int_experts(experts: int, rows: int, k: int, bits: int, group_size: int,
                 gen: torch.Generator, device: str = DEVICE) -> IntExperts:
    q, zeros, scales = _int_values(experts, rows, k, bits, group_size, gen)
    return pack_int_experts(q.to(device), zeros.to(device), scales.to(device), bits, group_size)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like give NaN-filled float tensors while the test runs: a slot of
    fused_moe's buffers or output that a kernel leaves unwritten shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(empty_like(*a, **kw)))


@pytest.mark.parametrize(("bits", "group_size"), [(4, 8), (4, 16), (4, 32), (8, 4), (8, 32)])
def test_int_experts_dequantize_matches_elementwise(bits, group_size) -> None:
    experts, rows, k = 3, 5, 32
    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    q, zeros, scales = _int_values(experts, rows, k, bits, group_size, gen)
    packed = pack_int_experts(q.to(torch.uint8), zeros, scales, bits, group_size)
    per_word = 32 // bits
    assert packed.shape == (experts, rows, k)
    assert packed.qweight.shape == (experts, rows, k // per_word)
    assert packed.qweight.dtype == torch.int32 and packed.zeros.dtype == torch.float16
    # the layout, element by element: k = j * P + i at bits [i * bits, (i + 1) * bits) of
    # word [e, n, j], unsigned (a word's top value may set int32's sign bit)
    words = packed.qweight.tolist()
    for e in range(experts):
        for n in range(rows):
            for kk in range(k):
                word = words[e][n][kk // per_word] & 0xFFFFFFFF
                assert (word >> (kk % per_word * bits)) & ((1 << bits) - 1) == q[e, n, kk]
    assert (packed.qweight < 0).any()          # some words use the sign bit (checked above)
    # w = (q - zero) * scale of k's group, in fp32, rounded once to the dtype asked
    expected = torch.empty(experts, rows, k)
    for kk in range(k):
        g = kk // group_size
        expected[:, :, kk] = (q[:, :, kk].float() - zeros[:, :, g].float()) * scales[:, :, g].float()
    assert torch.equal(packed.dequantize(torch.float32), expected)
    assert torch.equal(packed.dequantize(torch.float16), expected.half())
    assert torch.equal(packed.dequantize(torch.bfloat16, slice(1, 3)), expected[1:3].bfloat16())
    assert torch.equal(packed.dequantize(torch.float32, 2), expected[2:3])


# (tokens, bits, w13's group, w2's group, hidden, inter, gemv, tiles): groups below the CPU
# tiles' BLOCK_K (32 grouped, 128 GEMV), a group = K (one a row), 48 (a group boundary inside
# a 32-wide tile), a last tile past K (inter 48 or 40); gemv with 16 x 32 tiles (several K
# tiles, one group a tile: the one-group branch); 23 / 40 tokens: several pairs an expert.
INT_CASES = [
    (23, 4, 16, 16, 64, 48, False, None),
    (40, 8, 64, 48, 64, 48, False, None),
    (23, 4, 48, 8, 96, 40, False, None),
    (3, 4, 16, 16, 64, 48, True, None),
    (3, 8, 64, 48, 64, 48, True, None),
    (4, 4, 32, 64, 96, 64, True, (GemvTiles(16, 32, 4), GemvTiles(16, 32, 4))),
    (40, 8, 32, 16, 64, 48, False, GroupedTiles(16, 32, 64, 4, 1)),
]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("tokens", "bits", "group13", "group2", "hidden", "inter", "gemv",
                          "tiles"), INT_CASES)
def test_int_experts_match_the_reference(poisoned, dtype, tokens, bits, group13, group2,
                                         hidden, inter, gemv, tiles) -> None:
    experts, top_k = 6, 2
    gen = torch.Generator().manual_seed(tokens * 7 + bits)
    w13 = _int_experts(experts, 2 * inter, hidden, bits, group13, gen)
    w2 = _int_experts(experts, hidden, inter, bits, group2, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = moe_route_ref(torch.randn(tokens, experts, generator=gen), top_k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    assert torch.bincount(ids.flatten().cpu()).max() >= 2          # pairs sharing an expert
    out = fused_moe(x, w13, w2, weights, ids, gemv=gemv, tiles=tiles)
    ref = fused_moe_ref(x.float(), w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    scale = float(ref.abs().max())
    assert scale > 0.1
    torch.testing.assert_close(out.float() / scale, ref / scale, rtol=0.0,
                               atol=TOLERANCE[dtype] * 4)
    # the reference is the bf16 experts' one over the dequantized weights
    torch.testing.assert_close(
        ref, fused_moe_ref(x.float(), w13.dequantize(torch.float32), w2.dequantize(torch.float32),
                           weights, ids), rtol=0, atol=0)

    # the zero points and each group's scale matter: a kernel ignoring them would be far off
    def far(mutated13: IntExperts, mutated2: IntExperts) -> bool:
        other = fused_moe_ref(x.float(), mutated13, mutated2, weights, ids)
        return float((other - ref).abs().max()) / scale > 100 * TOLERANCE[dtype]

    def no_zeros(w: IntExperts) -> IntExperts:
        return IntExperts(w.qweight, w.scales, torch.zeros_like(w.zeros), w.bits, w.group_size)

    def first_group(w: IntExperts) -> IntExperts:
        return IntExperts(w.qweight, w.scales[:, :, :1].expand_as(w.scales).contiguous(),
                          w.zeros[:, :, :1].expand_as(w.zeros).contiguous(), w.bits,
                          w.group_size)

    assert far(no_zeros(w13), w2) and far(w13, no_zeros(w2))
    if group13 < hidden:
        assert far(first_group(w13), w2)
    if group2 < inter:
        assert far(w13, first_group(w2))


def _act_order(w: IntExperts, gen: torch.Generator) -> IntExperts:
    """w's packed values as act-order experts: each expert's inputs in a random order of its own
    (GPTQ desc_act, sorted by group: input perm[e, k] of x is packed k)."""
    experts, _, k = w.shape
    perm = torch.stack([torch.randperm(k, generator=gen, device=gen.device)
                        for _ in range(experts)])
    return IntExperts(w.qweight, w.scales, w.zeros, w.bits, w.group_size,
                      perm.to(torch.int32).to(w.qweight.device))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("tokens", "gemv", "tiles"), [
    (3, True, None), (23, False, None), (40, False, GroupedTiles(16, 32, 32, 4, 1))],
    ids=["gemv", "grouped", "grouped-k-tiles"])
def test_act_order_int_experts_match_the_reference(poisoned, dtype, tokens, gemv,
                                                   tiles) -> None:
    experts, top_k, hidden, inter = 6, 2, 64, 48
    gen = torch.Generator().manual_seed(tokens)
    plain13 = _int_experts(experts, 2 * inter, hidden, 4, 16, gen)
    plain2 = _int_experts(experts, hidden, inter, 8, 16, gen)
    w13, w2 = _act_order(plain13, gen), _act_order(plain2, gen)
    # the dequantized weight puts packed k at input perm[e, k]
    for w, plain in ((w13, plain13), (w2, plain2)):
        dense, packed = w.dequantize(torch.float32), plain.dequantize(torch.float32)
        for e in range(experts):
            assert torch.equal(dense[e][:, w.perm[e].long()], packed[e])
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = moe_route_ref(torch.randn(tokens, experts, generator=gen), top_k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    out = fused_moe(x, w13, w2, weights, ids, gemv=gemv, tiles=tiles)
    ref = fused_moe_ref(x.float(), w13, w2, weights, ids)
    scale = float(ref.abs().max())
    torch.testing.assert_close(out.float() / scale, ref / scale, rtol=0.0,
                               atol=TOLERANCE[dtype] * 4)
    # either permutation ignored would be far off
    for other in (fused_moe_ref(x.float(), plain13, w2, weights, ids),
                  fused_moe_ref(x.float(), w13, plain2, weights, ids)):
        assert float((other - ref).abs().max()) / scale > 100 * TOLERANCE[dtype]


def test_int_experts_refusals() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w13, w2, weights, ids = _case(3, 4, 2, 32, 48, torch.float32, seed=1, device="cpu")
    i13 = _int_experts(4, 96, 32, 4, 16, gen, device="cpu")
    i2 = _int_experts(4, 32, 48, 4, 16, gen, device="cpu")
    with pytest.raises(ValueError, match="w13 and w2 must both be IntExperts or neither"):
        fused_moe(x, i13, w2, weights, ids)
    with pytest.raises(ValueError, match="w13 and w2 must both be IntExperts or neither"):
        fused_moe(x, w13, i2, weights, ids)
    scale = torch.ones(4, 96)
    with pytest.raises(ValueError, match="integer experts take no FP8 scales"):
        fused_moe(x, i13, i2, weights, ids, w13_scale=scale)
    with pytest.raises(ValueError, match="integer experts take no FP8 scales"):
        fused_moe_ref(x, i13, i2, weights, ids, w13_scale=scale)
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, 32\] and w2 \[E, 32, I\]"):
        fused_moe(x, i13, _int_experts(4, 32, 40, 4, 8, gen, device="cpu"), weights, ids)
    with pytest.raises(ValueError, match="BLOCK_K must be a multiple of 8 for 4-bit experts"):
        fused_moe(x, i13, i2, weights, ids, gemv=False, tiles=GroupedTiles(16, 32, 4, 4, 1))
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused_moe(x, i13, IntExperts(i2.qweight, i2.scales, i2.zeros.transpose(0, 1).contiguous()
                                     .transpose(0, 1), 4, 16), weights, ids)
    # pack_int_experts checks its values, IntExperts its shapes
    q, zeros, scales = _int_values(2, 4, 32, 4, 16, gen)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        pack_int_experts(q, zeros, scales, 3, 16)
    with pytest.raises(ValueError, match=r"q must be in \[0, 16\)"):
        pack_int_experts(q + 1, zeros, scales, 4, 16)
    with pytest.raises(ValueError, match=r"q must be in \[0, 16\)"):
        pack_int_experts(q - 1, zeros, scales, 4, 16)
    with pytest.raises(ValueError, match="q must be an"):
        pack_int_experts(q.float(), zeros, scales, 4, 16)
    with pytest.raises(ValueError, match="zeros must be integer-valued"):
        pack_int_experts(q, zeros + 0.5, scales, 4, 16)
    with pytest.raises(ValueError, match="group_size must be a multiple of 8 dividing K = 32"):
        pack_int_experts(q, zeros, scales, 4, 12)
    with pytest.raises(ValueError, match="group_size must be a multiple of 8 dividing K = 32"):
        pack_int_experts(q, zeros, scales, 4, 24)
    with pytest.raises(ValueError, match=r"scales must be \[2, 4, 2\]"):
        pack_int_experts(q, zeros, scales[:, :, :1], 4, 16)
    with pytest.raises(ValueError, match=r"zeros must be \[2, 4, 2\]"):
        IntExperts(i13.qweight[:2, :4, :4], scales, zeros[:, :3], 4, 16)
    with pytest.raises(ValueError, match="qweight must be"):
        IntExperts(i13.qweight[:2, :4, :4].float(), scales, zeros, 4, 16)
    with pytest.raises(ValueError, match="zeros must be in the scales' dtype"):
        IntExperts(i13.qweight[:2, :4, :4], scales, zeros.float(), 4, 16)
    perm = torch.arange(32, dtype=torch.int32).repeat(2, 1)
    IntExperts(i13.qweight[:2, :4, :4], scales, zeros, 4, 16, perm)
    for bad in (perm.long(), perm[:, :16], perm[:1]):
        with pytest.raises(ValueError, match=r"perm must be \[2, 32\] int32"):
            IntExperts(i13.qweight[:2, :4, :4], scales, zeros, 4, 16, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_gpu_int4_experts_qwen3_moe(tokens: int) -> None:
    # Qwen3-30B-A3B's experts (hidden 2048, inter 768, 128 experts, top 8), GPTQ-like 4-bit
    # groups of 128, bf16 activations, both paths against the fp32 reference over the exact
    # dequantized weights
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = _int_experts(experts, 2 * inter, hidden, 4, 128, gen, device="cuda")
    w2 = _int_experts(experts, hidden, inter, 4, 128, gen, device="cuda")
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    weights, ids = moe_route_ref(logits, top_k, True)
    ref = fused_moe_ref(x.float(), w13, w2, weights, ids)
    scale = float(ref.abs().max())
    assert scale > 0.1
    for gemv in (True, False, None):
        out = fused_moe(x, w13, w2, weights, ids, gemv=gemv)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        torch.testing.assert_close(out.float() / scale, ref / scale, rtol=0.0, atol=2e-2)
        # bf16's roundings (weights, the pairs' activations, the output): about 5e-3
        assert float((out.float() - ref).norm() / ref.norm()) < 1.5e-2
    # the zero points matter at this size too
    no_zeros = IntExperts(w13.qweight, w13.scales, torch.zeros_like(w13.zeros), 4, 128)
    other = fused_moe(x, no_zeros, w2, weights, ids)
    assert float((other.float() - ref).abs().max()) / scale > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300])
def test_gpu_act_order_int4_experts_qwen3_moe(tokens: int) -> None:
    # the same shapes as act-order experts (GPTQ desc_act): each path gathers its inputs
    # through the experts' permutations
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = _act_order(_int_experts(experts, 2 * inter, hidden, 4, 128, gen, device="cuda"), gen)
    w2 = _act_order(_int_experts(experts, hidden, inter, 4, 128, gen, device="cuda"), gen)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = moe_route_ref(torch.randn(tokens, experts, generator=gen, device="cuda"),
                                 top_k, True)
    ref = fused_moe_ref(x.float(), w13, w2, weights, ids)
    for gemv in (True, False):
        out = fused_moe(x, w13, w2, weights, ids, gemv=gemv)
        assert float((out.float() - ref).norm() / ref.norm()) < 1.5e-2
