"""rms_norm_int8 and silu_and_mul_int8 (the per-token int8 quantization of W8A8 fused into the
kernel that writes the activation) against the unfused composition: rms_norm / silu_and_mul,
then quantize_int8_per_token. Bit for bit, int8 values and fp32 scales, in the interpreter
(which computes int8 exactly, unlike e4m3); the gpu-marked cases at Llama shapes, where two
compilations may round a rare norm or SiLU output a last bit apart (GPU_MAX_DIFFERING).
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.activation import (
    silu_and_mul,
    silu_and_mul_int8,
    silu_and_mul_int8_ref,
    silu_and_mul_ref,
)
from kvfleet_kernels.fp8 import _ONE_PASS_MAX
from kvfleet_kernels.int8 import quantize_int8_per_token, quantize_int8_per_token_ref
from kvfleet_kernels.norm import rms_norm_int8, rms_norm_int8_ref, rms_norm_ref
from test_kernel_fp8_fused import (
    CPU_DTYPES,
    DEVICE,
    GPU_DTYPES,
    GPU_MAX_DIFFERING,
    _rows,
    check_rms_norm_quantized,
    check_silu_and_mul_quantized,
)


def _assert_identical(fused: tuple[torch.Tensor, torch.Tensor],
                      unfused: tuple[torch.Tensor, torch.Tensor], max_differing: float = 0.0
                      ) -> None:
    (q, scale), (q_ref, scale_ref) = fused, unfused
    assert q.dtype == q_ref.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.shape == scale_ref.shape == (q.shape[0], 1) and q.shape == q_ref.shape
    if DEVICE == "cpu" and not max_differing:
        assert torch.equal(scale, scale_ref)
        assert torch.equal(q, q_ref)
        return
    torch.testing.assert_close(scale, scale_ref, rtol=2 ** -7, atol=0)
    same_scale = (scale == scale_ref).squeeze(1)
    assert int((~same_scale).sum()) <= max(1, q.shape[0] // 100)     # a rare row's amax
    diff = (q[same_scale].int() - q_ref[same_scale].int()).abs()
    assert (diff <= 1).all(), int(diff.max())                       # the next integer at most
    assert (diff != 0).float().mean().item() <= max(max_differing, GPU_MAX_DIFFERING)


def _check_rms_norm_int8(rows: int, dim: int, dtype: torch.dtype, seed: int,
                         weight_size: float = 1.0) -> None:
    check_rms_norm_quantized(rms_norm_int8, quantize_int8_per_token, _assert_identical, rows, dim,
                             dtype, seed, weight_size)


def _check_silu_and_mul_int8(rows: int, inter: int, dtype: torch.dtype, seed: int,
                             magnitude: float = 1.0) -> None:
    # the exact kernel only: the default's approximate divisions are the GPU test's case below
    check_silu_and_mul_quantized(silu_and_mul_int8, quantize_int8_per_token, _assert_identical,
                                 rows, inter, dtype, seed, magnitude, fast=(False,))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows, dim, weight_size", [(5, 64, 1.0), (4, 200, 1.0), (4, 200, 300.0)])
def test_rms_norm_int8_is_rms_norm_then_quantize(dtype, rows, dim, weight_size):
    _check_rms_norm_int8(rows, dim, dtype, seed=dim + rows, weight_size=weight_size)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
# magnitude 5: SiLU(gate) * up reaches ~4e4, near fp16's largest (65504)
@pytest.mark.parametrize("rows, inter, magnitude", [(5, 80, 1.0), (4, 96, 5.0),
                                                    (2, _ONE_PASS_MAX + 616, 1.0)])
def test_silu_and_mul_int8_is_silu_and_mul_then_quantize(dtype, rows, inter, magnitude):
    # the last case is over the one-pass limit: amax in one pass, the values in a second
    _check_silu_and_mul_int8(rows, inter, dtype, seed=inter + rows, magnitude=magnitude)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_silu_and_mul_int8_fast_multiplies_by_the_inverse_scale(dtype):
    # fast: each value times fp32(1 / scale), rounded half to even (the interpreter's SiLU
    # divides exactly either way, so the scales are the same)
    x = _rows(6, 2 * 300, dtype, seed=7, magnitude=3.0)
    (q_fast, s_fast), (q, s) = silu_and_mul_int8(x, fast=True), silu_and_mul_int8(x, fast=False)
    assert torch.equal(s_fast, s)
    y = silu_and_mul(x).float()
    expected = torch.round(y * (1.0 / s)).clamp(-128, 127).to(torch.int8)
    assert torch.equal(q_fast, expected)
    assert ((q_fast.int() - q.int()).abs() <= 1).all()
    # two-pass rows (over the one-pass limit) stay exact
    x = _rows(2, 2 * (_ONE_PASS_MAX + 16), dtype, seed=8)
    assert torch.equal(silu_and_mul_int8(x, fast=True)[0], silu_and_mul_int8(x, fast=False)[0])


def test_fused_references_are_the_unfused_references():
    x = _rows(4, 96, torch.float32, seed=1)
    q, scale = silu_and_mul_int8_ref(x)
    assert q.dtype == torch.int8 and scale.shape == (4, 1)
    assert not q[0].any() and 0 < scale[0].item() < 1e-13      # the all-zero row
    assert torch.equal(q, quantize_int8_per_token_ref(silu_and_mul_ref(x))[0])
    weight = torch.rand(96) + 0.5
    q, scale, summed = rms_norm_int8_ref(x, weight, 1e-6, residual=x)
    assert torch.equal(summed, x + x) and scale.shape == (4, 1)
    normed = rms_norm_ref(x, weight, 1e-6, residual=x)[0]
    assert ((q.float() * scale - normed).abs() <= scale * 0.5 * (1 + 1e-6)).all()
    assert rms_norm_int8_ref(x, weight, 1e-6)[2] is None


def test_fused_int8_kernels_write_int8_and_refuse_what_the_unfused_ones_refuse():
    x = torch.zeros(3, 8, device=DEVICE)
    q, scale, summed = rms_norm_int8(x, torch.ones(8, device=DEVICE), 1e-6, x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and summed.shape == (3, 8)
    q, scale = silu_and_mul_int8(x)
    assert q.shape == (3, 4) and q.dtype == torch.int8 and scale.shape == (3, 1)
    assert silu_and_mul_int8(x[:0])[0].shape == (0, 4)
    with pytest.raises(ValueError, match="2 \\* intermediate_size"):
        silu_and_mul_int8(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_int8(x, torch.ones(4, device=DEVICE), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_fused_int8_kernels_at_llama_shapes(dtype):
    for rows, dim, seed in ((1, 4096, 30), (2048, 4096, 31), (300, 8192, 32), (7, 5000, 33)):
        _check_rms_norm_int8(rows, dim, dtype, seed)
    _check_rms_norm_int8(64, 4096, dtype, seed=34, weight_size=100.0)
    for rows, inter, seed in ((2048, 14336, 35), (33, 29568, 37), (5, 1000, 38)):
        _check_silu_and_mul_int8(rows, inter, dtype, seed)
    # the GPU default (approximate SiLU division, values times 1 / scale): a value near a
    # rounding boundary may land on the next integer
    x = _rows(2048, 2 * 14336, dtype, seed=39)
    _assert_identical(silu_and_mul_int8(x), quantize_int8_per_token(silu_and_mul(x)),
                      max_differing=1e-3)


@pytest.mark.gpu
def test_gpu_fused_int8_kernels_match_the_torch_references():
    # the kernels and the torch references may round the norm or SiLU a last bf16 bit apart
    x = _rows(512, 4096, torch.bfloat16, seed=40)
    weight = (1 + 0.1 * torch.randn(4096, device=DEVICE)).bfloat16()
    q, scale, summed = rms_norm_int8(x, weight, 1e-6, x)
    q_ref, scale_ref, summed_ref = rms_norm_int8_ref(x, weight, 1e-6, x)
    _assert_identical((q, scale), (q_ref, scale_ref), max_differing=1e-3)
    assert torch.equal(summed, summed_ref)
    x = _rows(512, 2 * 14336, torch.bfloat16, seed=41)
    _assert_identical(silu_and_mul_int8(x), silu_and_mul_int8_ref(x), max_differing=1e-3)
