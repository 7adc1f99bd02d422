"""The per-token FP8 activation quantization kernel against quantize_fp8_per_token_ref.

Triton's interpreter rounds some values to e4m3 wrongly (triton 3.x: 7.76 -> 4.0), so on a CPU
the kernel writes its pre-cast values (the clamped x / scale) into an fp32 buffer and those,
and the scales, are compared exactly; the GPU case compares the e4m3 bytes themselves.
"""

from __future__ import annotations

import pytest
import torch
from kvfleet_kernels.fp8 import FP8_MAX, quantize_fp8_per_token_ref, quantize_fp8_rowwise_triton
from kvfleet_kernels.quant_row import _quantize_rows_kernel, quantize_rows


def _rows(rows: int, cols: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    t[0] = 0.0                        # an all-zero row: the minimum scale, no NaN
    return t.to(dtype=dtype, device=device)


@pytest.mark.parametrize("cols, one_pass, block", [(96, True, 128), (300, False, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_scales_and_values_before_the_cast_are_torchs(cols, one_pass, block, dtype):
    t = _rows(5, cols, dtype, "cpu", seed=cols)
    q = torch.full((5, cols), float("nan"))
    scale = torch.full((5, 1), float("nan"))
    _quantize_rows_kernel[(5,)](t, q, scale, cols, t.stride(0), q.stride(0),
                                BLOCK=block, ONE_PASS=one_pass, INT8=False)
    inv = torch.tensor(1 / FP8_MAX, dtype=torch.float32)
    ref_scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) * inv
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q, (t.float() / ref_scale).clamp(-FP8_MAX, FP8_MAX))


def test_non_contiguous_rows_are_refused():
    with pytest.raises(ValueError, match="contiguous last dimension"):
        quantize_fp8_rowwise_triton(torch.zeros(4, 8).t())


def test_rows_quantize_to_e4m3_or_int8_only():
    with pytest.raises(ValueError, match="dtype must be"):
        quantize_rows(torch.zeros(4, 8), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols", [(1, 4096), (1024, 4096), (7, 14336), (3, 20000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernel_is_bit_identical_to_torch(rows, cols, dtype):
    t = _rows(rows, cols, dtype, "cuda", seed=rows + cols)
    q, scale = quantize_fp8_rowwise_triton(t)
    q_ref, scale_ref = quantize_fp8_per_token_ref(t)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
