"""Per-token (per-row) quantization of activations to e4m3 or int8: one kernel for both.

Every kernel that writes a row quantized (this module's `quantize_rows`, RMSNorm's and
SiLU-and-mul's fused outputs) takes the row's scale and values through `row_scale` and
`row_quantize`, so they agree bit for bit: e4m3 as fp8.py's `fp8_scale` / `fp8_quantize`
(x / scale, IEEE division, saturated; the store's cast rounds), int8 as int8.py's `int8_scale`
/ `int8_round` (rounded half to even, saturated). `fp8.quantize_fp8_rowwise_triton` and
`int8.quantize_int8_per_token` are this module's kernel with their dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.fp8 import FP8, FP8_E4M3_MAX, fp8_quantize, fp8_scale, one_pass_block
from kvfleet_kernels.int8 import int8_round, int8_scale


@triton.jit
def row_scale(amax, INT8: tl.constexpr):
    # the per-token scale of a row whose largest |value| is amax
    if INT8:
        return int8_scale(amax)
    return fp8_scale(amax)


@triton.jit
def row_quantize(y, scale, INT8: tl.constexpr, FAST: tl.constexpr = False):
    # y / scale as the per-token quantization kernels compute it (FAST: y * (1 / scale)),
    # saturated, in fp32: e4m3 values before the store's rounding, int8 ones rounded already
    if INT8:
        q = int8_round(y, scale, FAST)
    elif FAST:
        q = tl.clamp(y * (1.0 / scale), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    else:
        q = fp8_quantize(y, scale)
    return q


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, C, stride_x, stride_q,
                          BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, INT8: tl.constexpr):
    # One program per row: amax, scale, q (e4m3, or int8 with INT8). A row longer than the
    # one-pass limit is read twice (amax, then the values).
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < C
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, C, BLOCK):
            mask = start + offs < C
            x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        amax = tl.max(amax, 0)
    scale = row_scale(amax, INT8)
    if ONE_PASS:
        tl.store(q_row + offs, row_quantize(x, scale, INT8).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        for start in range(0, C, BLOCK):
            mask = start + offs < C
            x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + start + offs, row_quantize(x, scale, INT8).to(q_ptr.dtype.element_ty),
                     mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] with a contiguous last dimension -> (q in dtype (e4m3 or int8) [R, C], fp32
    scales [R, 1]), each row quantized with its own scale (the module docstring)."""
    if dtype not in (FP8, torch.int8):
        raise ValueError(f"dtype must be {FP8} or torch.int8; got {dtype}")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expected a [R, C] tensor with a contiguous last dimension; got "
                         f"shape {tuple(x.shape)}, strides {tuple(x.stride())}")
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        one_pass, block, num_warps = one_pass_block(cols)
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), BLOCK=block,
                                       ONE_PASS=one_pass, INT8=dtype == torch.int8,
                                       num_warps=num_warps)
    return q, scale
