"""FP8 (e4m3) linear: per-channel weight scales, dynamic per-token activation scales.

fp8_linear runs torch._scaled_mm (cuBLASLt FP8 GEMM with row-wise scales) on GPUs of compute
capability >= 8.9 (Ada, Hopper); fp8_linear_ref computes the same quantized product in fp32
and is what it is tested against.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max        # 448
_MIN_SCALE = 1e-12                     # an all-zero row still gets a finite scale


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each row of t: [R, C] to the fp8 range. Returns (fp8 [R, C], fp32 scales [R, 1])."""
    scale = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) / FP8_MAX
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: fp8 [N, K], weight_scale: fp32 [N] -> [M, N] in x's dtype."""
    xq, x_scale = quantize_fp8_rowwise(x)
    out = (xq.float() * x_scale) @ (weight.float() * weight_scale.float()[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """As fp8_linear_ref, on the GPU's FP8 tensor cores (K and N multiples of 16)."""
    xq, x_scale = quantize_fp8_rowwise(x)
    # row-wise scaling in _scaled_mm produces bf16 only; weight.t() is the column-major operand
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale,
                           scale_b=weight_scale.float().reshape(1, -1), out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)
