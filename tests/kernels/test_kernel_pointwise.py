"""rms_norm, rotary_embedding, rotary_and_cache and silu_and_mul (Triton) against their torch
references.

CPU cases run in Triton's interpreter (fp32, fp16); gpu-marked cases use Llama-3.1-8B shapes in
bf16 and fp16. Each case draws fresh inputs; the inputs are checked untouched afterwards.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.activation import silu_and_mul, silu_and_mul_ref
from kvfleet_kernels.norm import rms_norm, rms_norm_ref
from kvfleet_kernels.paged_attention import head_major_k, token_major_v
from kvfleet_kernels.rotary import (
    rotary_and_cache,
    rotary_and_cache_ref,
    rotary_embedding,
    rotary_embedding_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16]
# Two rounding steps of the output dtype (fp32: summation order only): rms_norm rounds the
# normalised value before the weight multiply, so a last-bit difference there can double.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Relative as well: rms_norm outputs and rotated values reach |x| ~ 4.
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def _cos_sin_cache(max_pos: int, rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


def _check_rms_norm(num_tokens: int, dim: int, dtype: torch.dtype, seed: int) -> None:
    x = _randn(num_tokens, dim, dtype=dtype, seed=seed)
    residual = _randn(num_tokens, dim, dtype=dtype, seed=seed + 1)
    weight = (1 + 0.1 * _randn(dim, dtype=torch.float32, seed=seed + 2)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    _close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    out, summed = rms_norm(x, weight, 1e-5, residual)
    out_ref, summed_ref = rms_norm_ref(x, weight, 1e-5, residual)
    _close(out, out_ref)
    torch.testing.assert_close(summed, summed_ref, rtol=0, atol=0)   # one rounding, exactly torch's
    # out_perm: the same values in the order out_perm gives them (an act-order layer's input
    # order), the residual sum as before
    perm = torch.randperm(dim, generator=torch.Generator().manual_seed(seed + 3)).to(DEVICE)
    out_p, summed_p = rms_norm(x, weight, 1e-5, residual, out_perm=perm.to(torch.int32))
    assert torch.equal(out_p, out[:, perm]) and torch.equal(summed_p, summed)
    assert torch.equal(rms_norm(x, weight, 1e-6, out_perm=perm.to(torch.int32)),
                       rms_norm(x, weight, 1e-6)[:, perm])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("dim", [64, 96])
def test_rms_norm_and_fused_residual_add(dtype: torch.dtype, dim: int) -> None:
    _check_rms_norm(5, dim, dtype, seed=dim)


def test_rms_norm_out_perm_must_be_an_int32_permutation_of_the_columns() -> None:
    x, weight = torch.ones(2, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    for bad in (torch.arange(8, device=DEVICE), torch.arange(4, dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match="out_perm must be an int32 \\[8\\]"):
            rms_norm(x, weight, 1e-6, out_perm=bad)


def test_rms_norm_reference_matches_hf_llama_rmsnorm() -> None:
    # HF LlamaRMSNorm.forward, written out: normalise in fp32, cast, then multiply by the weight.
    x = _randn(3, 64, dtype=torch.float16, seed=9)
    weight = _randn(64, dtype=torch.float16, seed=10)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-6), weight * h.to(torch.float16),
                               rtol=0, atol=0)


def _check_rotary(num_q_heads: int, num_kv_heads: int, head_size: int, rot_dim: int,
                  is_neox: bool, dtype: torch.dtype, num_tokens: int, seed: int) -> None:
    cache = _cos_sin_cache(4096, rot_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    positions = positions.to(DEVICE)
    # query is a column slice of a fused qkv output, as the attention layer produces it.
    qkv = _randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=seed)
    query, key = qkv[:, :num_q_heads * head_size], qkv[:, num_q_heads * head_size:][:, :num_kv_heads * head_size]
    qkv_before = qkv.clone()
    q_out, k_out = rotary_embedding(positions, query, key, head_size, cache, is_neox)
    q_ref, k_ref = rotary_embedding_ref(positions, query, key, head_size, cache, is_neox)
    _close(q_out, q_ref)
    _close(k_out, k_ref)
    assert torch.equal(qkv, qkv_before)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16, 12])
def test_rotary_embedding_full_and_partial(dtype: torch.dtype, is_neox: bool, rot_dim: int) -> None:
    _check_rotary(4, 2, 32, rot_dim, is_neox, dtype, num_tokens=6, seed=rot_dim)


def _check_rotary_and_cache(num_q_heads: int, num_kv_heads: int, head_size: int, rot_dim: int,
                            is_neox: bool, dtype: torch.dtype, num_tokens: int, block_size: int,
                            seed: int, cache_dtype: torch.dtype | None = None,
                            v_token_major: bool = False, k_head_major: bool = False,
                            scales: tuple[float, float] = (1.0, 1.0)) -> None:
    cache = _cos_sin_cache(4096, rot_dim)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    qkv = _randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=seed)
    q_size, kv_size = num_q_heads * head_size, num_kv_heads * head_size
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    num_blocks = num_tokens // block_size + 3
    # distinct slots in scrambled order across blocks; every third token is padding (-1)
    perm = torch.randperm(num_blocks * block_size, generator=gen)
    zero = int((perm == 0).nonzero())
    perm[[1, zero]] = perm[[zero, 1]]             # slot 0 (block 0, offset 0) is written too
    slots = perm[:num_tokens]
    slots[::3] = -1
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    cache_dtype = cache_dtype or dtype
    caches = [_randn(*shape, dtype=torch.float32, seed=seed + i).to(cache_dtype) for i in range(2)]
    expected = [c.clone() for c in caches]
    if v_token_major:     # the kernel writes V token-major; the reference into rows
        caches[1] = token_major_v(torch.empty_like(caches[1])).copy_(caches[1])
    if k_head_major:      # the kernel writes K head-major; the reference into rows
        caches[0] = head_major_k(torch.empty_like(caches[0])).copy_(caches[0])
    qkv_before = qkv.clone()
    q_out = rotary_and_cache(positions, query, key, value, head_size, cache, is_neox, *caches,
                             slots, *scales)
    q_ref = rotary_and_cache_ref(positions, query, key, value, head_size, cache, is_neox,
                                 *expected, slots, *scales)
    _close(q_out, q_ref)
    # The rotated keys went through the same rounding as the query: compare them like q;
    # values are copies (bit-exact); untouched slots keep their old contents.
    written = slots[slots >= 0]
    blocks, offsets = written // block_size, written % block_size
    for actual, ref in zip(caches, expected, strict=True):
        mask = torch.ones(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
        mask[blocks, offsets] = False
        assert torch.equal(actual[mask].view(torch.uint8), ref[mask].view(torch.uint8))
    _close(caches[0][blocks, offsets].to(dtype), expected[0][blocks, offsets].to(dtype))
    assert torch.equal(caches[1][blocks, offsets].view(torch.uint8),
                       expected[1][blocks, offsets].view(torch.uint8))
    assert torch.equal(qkv, qkv_before)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rot_dim", [32, 12])
def test_rotary_and_cache_matches_rotary_then_cache_write(dtype: torch.dtype, rot_dim: int) -> None:
    _check_rotary_and_cache(4, 2, 32, rot_dim, True, dtype, num_tokens=7, block_size=4, seed=rot_dim)
    _check_rotary_and_cache(4, 1, 32, rot_dim, False, dtype, num_tokens=5, block_size=2, seed=rot_dim + 1)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rotary_and_cache_writes_a_token_major_v_cache(dtype: torch.dtype) -> None:
    # the engine's fp8 layout (paged_attention.token_major_v), here in the activation dtype: the
    # interpreter's fp8 rounding is off (test_kernel_kv_fp8.py); the GPU test writes e4m3
    _check_rotary_and_cache(4, 2, 32, 32, True, dtype, num_tokens=9, block_size=4, seed=40,
                            v_token_major=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rotary_and_cache_writes_a_head_major_k_cache(dtype: torch.dtype) -> None:
    # KVFLEET_K_HEAD_MAJOR=1's fp8 layout (paged_attention.head_major_k), V token-major beside it
    _check_rotary_and_cache(4, 2, 32, 32, True, dtype, num_tokens=9, block_size=4, seed=41,
                            v_token_major=True, k_head_major=True)


def test_rotary_and_cache_rejects_a_cache_of_the_wrong_shape() -> None:
    cache = _cos_sin_cache(16, 8)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    q, k = torch.zeros(2, 16, device=DEVICE), torch.zeros(2, 8, device=DEVICE)
    wrong = torch.zeros(4, 4, 2, 8, device=DEVICE)     # 2 kv heads; key holds 1
    with pytest.raises(ValueError, match="k_cache must be"):
        rotary_and_cache(positions, q, k, k, 8, cache, True, wrong, wrong,
                         torch.zeros(2, dtype=torch.long, device=DEVICE))


def test_rotary_reference_rotates_pairs_the_hf_way() -> None:
    # HF apply_rotary_pos_emb with rotate_half, full rotary, one head.
    cache = _cos_sin_cache(16, 8)
    positions = torch.tensor([3, 11], device=DEVICE)
    q = _randn(2, 8, dtype=torch.float32, seed=11)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    rotate_half = torch.cat((-q[:, 4:], q[:, :4]), dim=-1)
    q_ref, _ = rotary_embedding_ref(positions, q, q, 8, cache, True)
    torch.testing.assert_close(q_ref, q * cos + rotate_half * sin)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = _randn(4, 2 * 80, dtype=dtype, seed=12)
    _close(silu_and_mul(x), silu_and_mul_ref(x))


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="2 \\* intermediate_size"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_pointwise_kernels_at_llama_8b_shapes(dtype: torch.dtype) -> None:
    _check_rms_norm(2048, 4096, dtype, seed=20)
    _check_rotary(32, 8, 128, 128, True, dtype, num_tokens=2048, seed=21)
    _check_rotary(32, 8, 128, 64, False, dtype, num_tokens=300, seed=22)
    _check_rotary_and_cache(32, 8, 128, 128, True, dtype, num_tokens=2048, block_size=16, seed=24)
    _check_rotary_and_cache(32, 8, 128, 128, True, dtype, num_tokens=300, block_size=16, seed=25,
                            cache_dtype=torch.float8_e4m3fn)
    _check_rotary_and_cache(32, 8, 128, 128, True, dtype, num_tokens=300, block_size=16, seed=26,
                            cache_dtype=torch.float8_e4m3fn, v_token_major=True)
    _check_rotary_and_cache(32, 8, 128, 128, True, dtype, num_tokens=300, block_size=16, seed=27,
                            cache_dtype=torch.float8_e4m3fn, v_token_major=True, k_head_major=True)
    # an fp8 cache's calibrated scales (K / k_scale, V / v_scale)
    _check_rotary_and_cache(32, 8, 128, 128, True, dtype, num_tokens=300, block_size=16, seed=28,
                            cache_dtype=torch.float8_e4m3fn, v_token_major=True,
                            scales=(0.031, 0.0077))
    x = _randn(2048, 2 * 14336, dtype=dtype, seed=23)
    _close(silu_and_mul(x), silu_and_mul_ref(x))
