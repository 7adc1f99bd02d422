"""SiLU-and-mul: the gated MLP activation over a fused gate_up projection, quantized per token
to FP8 in the same kernel when its output feeds an FP8 GEMM (`fp8_out`), to int8 when it feeds
a W8A8 int8 GEMM (`int8_out`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_runtime.layers.backend import use_triton
from kvfleet_runtime.layers.quantization.fp8 import (
    FP8Activation,
    Int8Activation,
    takes_fp8_activation,
)


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fp8_out = False      # set at load time by an FP8 consumer (quantization.fp8.feeds_fp8)
        self.int8_out = False     # the same by a W8A8 int8 consumer

    def forward(self, x: torch.Tensor) -> torch.Tensor | FP8Activation | Int8Activation:
        # x: [T, 2I] -> [T, I]
        if self.fp8_out and takes_fp8_activation(x):
            from kvfleet_kernels.activation import silu_and_mul_fp8
            return FP8Activation(*silu_and_mul_fp8(x), x.dtype)
        if self.int8_out and takes_fp8_activation(x):
            from kvfleet_kernels.activation import silu_and_mul_int8
            return Int8Activation(*silu_and_mul_int8(x), x.dtype)
        if use_triton(x):
            from kvfleet_kernels.activation import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
