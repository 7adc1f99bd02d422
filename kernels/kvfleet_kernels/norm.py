"""RMSNorm, optionally fused with the residual add of a pre-norm block: torch reference and Triton twin.

Rounding follows HF LlamaRMSNorm: the sum x + residual is rounded to x.dtype (it is the next
block's residual), the normalisation runs in fp32, the normalised value is rounded to x.dtype
BEFORE it is multiplied by the weight, and that product is rounded to x.dtype once more.

`out_perm` (rms_norm): the output comes out as `out[:, out_perm]` (an act-order GPTQ layer's
input order, so the layer needs no gather of its own); the values are unchanged. The program
gathers its row's columns in registers and shared memory (`tl.gather`) and stores them in
order: each column stored at its place in global memory instead was a 2-byte store a column,
~2 us of one SM's stores a norm at batch 1.

`rms_norm_fp8` writes that rounded output quantized per token to e4m3 instead (the input of an
FP8 GEMM): rms_norm followed by quantize_fp8_rowwise_triton (bit for bit in the interpreter;
on the GPU a rare value one e4m3 step off, docs/KERNELS.md), one kernel fewer and no
bf16 activation written and read back. `rms_norm_int8` the same for an int8 GEMM (W8A8):
rms_norm followed by int8.quantize_int8_per_token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet_kernels.fp8 import FP8, quantize_fp8_per_token_ref
from kvfleet_kernels.int8 import quantize_int8_per_token_ref
from kvfleet_kernels.pdl import pdl_args, pdl_wait
from kvfleet_kernels.quant_row import row_quantize, row_scale


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, D]; weight: [D]. Returns out, or (out, x + residual) when residual is given."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h.to(x.dtype).float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


def _quantized_ref(quantize, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    out, summed = rms_norm_ref(x, weight, eps, residual) if residual is not None else (
        rms_norm_ref(x, weight, eps), None)
    return *quantize(out), summed


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(e4m3 [T, D], fp32 scales [T, 1], x + residual or None): rms_norm_ref's output quantized
    per token as quantize_fp8_per_token_ref does."""
    return _quantized_ref(quantize_fp8_per_token_ref, x, weight, eps, residual)


def rms_norm_int8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(int8 [T, D], fp32 scales [T, 1], x + residual or None): rms_norm_ref's output quantized
    per token as quantize_int8_per_token_ref does."""
    return _quantized_ref(quantize_int8_per_token_ref, x, weight, eps, residual)


@triton.jit
def residual_rms_norm_row(x, residual_ptr, weight_ptr, sum_ptr, row, stride_r, stride_s, d, mask,
                          eps, D: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One row x [BLOCK_D] (columns d, mask) -> its RMSNorm in x's dtype, rms_norm_ref's
    rounding; with HAS_RESIDUAL, x + residual (rounded) is normalised and stored to sum_ptr."""
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + d, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + d, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / D + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
    return (normed * w).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, scale_ptr, eps,
                     stride_x, stride_r, stride_o, stride_s,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     FP8_OUT: tl.constexpr, PDL: tl.constexpr = False,
                     INT8_OUT: tl.constexpr = False, perm_ptr=None,
                     OUT_PERM: tl.constexpr = False):
    # One program per row: the whole row fits one tile (D <= 16k). FP8_OUT: out_ptr takes the
    # output quantized per token to e4m3 (quant_row's row_scale, row_quantize), scale_ptr its
    # scale; INT8_OUT: the same to int8. OUT_PERM: column d of the (unquantized) output is the
    # row's column perm_ptr[d].
    pdl_wait(PDL)
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0)
    out = residual_rms_norm_row(x, residual_ptr, weight_ptr, sum_ptr, row, stride_r, stride_s,
                                d, mask, eps, D, HAS_RESIDUAL)
    if FP8_OUT or INT8_OUT:
        # the rounded output, as rms_norm writes it and the quantization kernel reads it back
        y = out.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), 0), INT8_OUT)
        tl.store(out_ptr + row * stride_o + d,
                 row_quantize(y, scale, INT8_OUT).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    elif OUT_PERM:
        src = tl.load(perm_ptr + d, mask=mask, other=0)
        tl.store(out_ptr + row * stride_o + d, tl.gather(out, src, 0), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + d, out, mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            out_dtype: torch.dtype | None = None, out_perm: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out in x.dtype, or quantized per token to out_dtype (e4m3 or int8) with its scales,
    x + residual if residual); out_perm: out's columns in that order (module docstring)."""
    num_tokens, dim = x.shape
    if weight.shape != (dim,):
        raise ValueError(f"weight must have shape ({dim},) to match x [T, {dim}]; got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension; got strides {tuple(t.stride())}")
    if out_dtype not in (None, FP8, torch.int8):
        raise ValueError(f"out_dtype must be None, {FP8} or torch.int8; got {out_dtype}")
    if out_perm is not None and (out_dtype is not None or out_perm.shape != (dim,)
                                 or out_perm.dtype != torch.int32):
        raise ValueError(f"out_perm must be an int32 [{dim}] (a permutation of the columns), "
                         f"with an unquantized output")
    out = torch.empty_like(x, dtype=out_dtype or x.dtype)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device) if out_dtype else None
    summed = torch.empty_like(x) if residual is not None else None
    if num_tokens:
        residual_arg = residual if residual is not None else x
        summed_arg = summed if summed is not None else out
        _rms_norm_kernel[(num_tokens,)](
            x, residual_arg, weight, out, summed_arg, scale if out_dtype else out, eps,
            x.stride(0), residual_arg.stride(0), out.stride(0), summed_arg.stride(0),
            D=dim, BLOCK_D=triton.next_power_of_2(dim), HAS_RESIDUAL=residual is not None,
            FP8_OUT=out_dtype == FP8, INT8_OUT=out_dtype == torch.int8,
            perm_ptr=out_perm, OUT_PERM=out_perm is not None,
            num_warps=8 if dim >= 4096 else 4, **pdl_args(x.device),
        )
    return out, scale, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out_perm: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `rms_norm_ref`; with out_perm (int32 [D]) the output is its [:, out_perm]
    (the module docstring)."""
    out, _, summed = _launch(x, weight, eps, residual, out_perm=out_perm)
    return out if residual is None else (out, summed)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton twin of `rms_norm_fp8_ref`, the same as rms_norm followed by
    quantize_fp8_rowwise_triton: (e4m3 [T, D], fp32 scales [T, 1], x + residual or None)."""
    return _launch(x, weight, eps, residual, FP8)


def rms_norm_int8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton twin of `rms_norm_int8_ref`, the same as rms_norm followed by
    quantize_int8_per_token: (int8 [T, D], fp32 scales [T, 1], x + residual or None)."""
    return _launch(x, weight, eps, residual, torch.int8)
