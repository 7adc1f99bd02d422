"""W8A8 int8 linear: int8 weights with per-channel scales, activations quantized per token.

`int8_linear` quantizes the activation's rows to int8 (one Triton kernel: scale = max|x| of
the row times fp32(1/127), q = x / scale rounded half to even, saturated to [-128, 127]), runs
the int8 x int8 -> int32 product on the integer tensor cores through cuBLAS (`torch._int_mm`,
which takes at least 17 rows: fewer are padded), and scales the int32 sums back in one Triton
epilogue (acc * x_scale * w_scale in fp32, + bias, rounded once to the output dtype).
`int8_linear_ref` computes the same in torch (exact integer sums) and is what it is tested
against: the integer product is exact, so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.fp8 import _MIN_SCALE, MIN_SCALE, one_pass_block

INT8_MAX = 127
_INV_INT8_MAX = torch.tensor(1.0 / INT8_MAX, dtype=torch.float32).item()   # fp32-rounded 1/127
INV_INT8_MAX = tl.constexpr(_INV_INT8_MAX)
# torch._int_mm on CUDA takes more than 16 rows, K and N multiples of 8
_INT_MM_MIN_ROWS = 17


def int8_supported(device: torch.device) -> bool:
    """Integer tensor cores through cuBLAS (torch._int_mm): Ampere and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def quantize_int8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (int8 [M, K], fp32 scales [M, 1]): scale = max(max|row|, 1e-12) * fp32(1/127),
    q = x / scale rounded half to even, saturated to [-128, 127]."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) * _INV_INT8_MAX
    q = torch.round(x.float() / scale).clamp(-128, INT8_MAX).to(torch.int8)
    return q, scale


@triton.jit
def _round_half_even(y):
    # rint for |y| < 2**22 (here |y| <= ~128): floor(y + 0.5), one less where y sat exactly
    # halfway and that landed on an odd integer (y + 0.5 is exact at these magnitudes)
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def int8_quantize(x, scale):
    # x / scale (IEEE round to nearest, as torch's division), rounded half to even, saturated
    q = _round_half_even(tl.math.div_rn(x, scale))
    return tl.clamp(q, -128.0, 127.0).to(tl.int8)


@triton.jit
def _quantize_int8_kernel(x_ptr, q_ptr, s_ptr, C, stride_x, stride_q,
                          BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    # One program per row: amax, scale, q (quantize_int8_per_token_ref)
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
    scale = tl.maximum(amax, MIN_SCALE) * INV_INT8_MAX
    if ONE_PASS:
        tl.store(q_row + offs, int8_quantize(x, scale), mask=mask)
    else:
        for start in range(0, C, BLOCK):
            mask = start + offs < C
            x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + start + offs, int8_quantize(x, scale), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_int8_per_token(x: torch.Tensor, rows: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_per_token_ref in one Triton kernel ([M, K] with a contiguous last
    dimension). rows >= M: the outputs get that many rows, those past M zero (padding for
    torch._int_mm's minimum; their scales 1.0)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expected a [M, K] tensor with a contiguous last dimension; got "
                         f"shape {tuple(x.shape)}, strides {tuple(x.stride())}")
    m, k = x.shape
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"rows ({rows}) must be at least x's {m}")
    alloc = torch.zeros if rows > m else torch.empty
    q = alloc((rows, k), dtype=torch.int8, device=x.device)
    scale = (torch.ones if rows > m else torch.empty)((rows, 1), dtype=torch.float32,
                                                      device=x.device)
    if m:
        one_pass, block, num_warps = one_pass_block(k)
        _quantize_int8_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block,
                                    ONE_PASS=one_pass, num_warps=num_warps)
    return q, scale


def int8_scale_ref(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int32 sums [M, N] -> acc * x_scale [M, 1] * w_scale [N] (+ bias) in fp32, in dtype."""
    out = acc.float() * x_scale.float() * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


@triton.jit
def _scale_kernel(acc_ptr, xs_ptr, ws_ptr, b_ptr, out_ptr, M, N, stride_acc, stride_out,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    acc = tl.load(acc_ptr + rows[:, None].to(tl.int64) * stride_acc + cols[None, :], mask=mask,
                  other=0)
    xs = tl.load(xs_ptr + rows, mask=rows < M, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
    out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def int8_scale(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, dtype: torch.dtype, rows: int | None = None
               ) -> torch.Tensor:
    """int8_scale_ref in one Triton kernel, over acc's first `rows` rows (default: all)."""
    m = acc.shape[0] if rows is None else rows
    n = acc.shape[1]
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    if m and n:
        on_gpu = acc.is_cuda
        block_m, block_n = (32, 128) if on_gpu else (64, 256)
        _scale_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            acc, x_scale, w_scale, bias if bias is not None else out, out, m, n, acc.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=4)
    return out


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: int8 [N, K], weight_scale: fp32 [N] -> [M, N] in x's dtype."""
    q, x_scale = quantize_int8_per_token_ref(x)
    acc = (q.long() @ weight.long().t()).to(torch.int32)      # exact: |sum| < 2**31 for K < 2**17
    return int8_scale_ref(acc, x_scale, weight_scale, bias, x.dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """As int8_linear_ref: the activation quantized per token (Triton), the int8 product on
    the integer tensor cores (torch._int_mm; K and N multiples of 8), the scales applied in a
    Triton epilogue."""
    m = x.shape[0]
    rows = max(m, _INT_MM_MIN_ROWS) if x.is_cuda else m
    q, x_scale = quantize_int8_per_token(x if x.stride(-1) == 1 else x.contiguous(), rows)
    # weight.t(): the column-major [K, N] operand cuBLAS takes
    acc = torch._int_mm(q, weight.t())
    return int8_scale(acc, x_scale, weight_scale, bias, x.dtype, rows=m)
