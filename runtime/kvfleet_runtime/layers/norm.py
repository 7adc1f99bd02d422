"""RMSNorm, optionally fused with the residual add (pre-norm decoder pattern), and with the
per-token FP8 quantization of its output when that output feeds an FP8 GEMM (`fp8_out`)."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet_runtime.layers.backend import use_triton
from kvfleet_runtime.layers.quantization.fp8 import FP8Activation, takes_fp8_activation


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    # HF order of operations: normalise in fp32, cast back, then scale by the weight
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.fp8_out = False      # set at load time by an FP8 consumer (quantization.fp8.feeds_fp8)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x: [T, D]; with residual returns (normed, x + residual); normed is an FP8Activation
        # where fp8_out and the consumer takes one
        if self.fp8_out and takes_fp8_activation(x):
            from kvfleet_kernels.norm import rms_norm_fp8
            q, scale, summed = rms_norm_fp8(x, self.weight, self.eps, residual)
            out = FP8Activation(q, scale, x.dtype)
            return out if residual is None else (out, summed)
        if use_triton(x):
            from kvfleet_kernels.norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_torch(x, self.weight, self.eps, residual)
