"""RMSNorm, optionally fused with the residual add (pre-norm decoder pattern)."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet_runtime.layers.backend import use_triton


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x: [T, D]; with residual returns (normed, x + residual)
        if use_triton(x):
            from kvfleet_kernels.norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_torch(x, self.weight, self.eps, residual)
