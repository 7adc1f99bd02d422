"""RMSNorm, optionally fused with the residual add of a pre-norm block: torch reference and Triton twin.

Rounding follows HF LlamaRMSNorm: the sum x + residual is rounded to x.dtype (it is the next
block's residual), the normalisation runs in fp32, the normalised value is rounded to x.dtype
BEFORE it is multiplied by the weight, and that product is rounded to x.dtype once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps,
                     stride_x, stride_r, stride_o, stride_s,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # One program per row: the whole row fits one tile (D <= 16k).
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + d, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + d, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / D + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + d, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `rms_norm_ref`."""
    num_tokens, dim = x.shape
    if weight.shape != (dim,):
        raise ValueError(f"weight must have shape ({dim},) to match x [T, {dim}]; got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension; got strides {tuple(t.stride())}")
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        residual_arg = residual if residual is not None else x
        _rms_norm_kernel[(num_tokens,)](
            x, residual_arg, weight, out, summed, eps,
            x.stride(0), residual_arg.stride(0), out.stride(0), summed.stride(0),
            D=dim, BLOCK_D=triton.next_power_of_2(dim), HAS_RESIDUAL=residual is not None,
            num_warps=8 if dim >= 4096 else 4,
        )
    return out if residual is None else (out, summed)
