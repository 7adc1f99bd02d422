"""SiLU-and-mul: the gated MLP activation over a fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_runtime.layers.backend import use_triton


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2I] -> [T, I]
        if use_triton(x):
            from kvfleet_kernels.activation import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
