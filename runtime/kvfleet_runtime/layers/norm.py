"""RMSNorm, optionally fused with the residual add (pre-norm decoder pattern), and with the
per-token FP8 quantization of its output when that output feeds an FP8 GEMM (`fp8_out`), or
the int8 one when it feeds a W8A8 int8 GEMM (`int8_out`), and with its output's columns in an
act-order GPTQ consumer's input order (`set_output_order`)."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet_runtime.distributed.communication import fused_norm_for, was_pushed
from kvfleet_runtime.layers.backend import use_triton
from kvfleet_runtime.layers.quantization.fp8 import (
    FP8Activation,
    Int8Activation,
    takes_fp8_activation,
)


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
        self.int8_out = False     # the same by a W8A8 int8 consumer
        self.reduces_input = False    # set by reduce_in_norm: x may be a rank's partial sum
        self.reduce_site = 0          # its place among the model's fused all-reduces
        # set_output_order's: the output is normed[:, out_perm] (int32, as the kernel takes it)
        self.out_perm = None

    def set_output_order(self, perm: torch.Tensor) -> None:
        """Hand the output over as normed[:, perm] (the act-order input order of the one layer
        that reads it, which then gathers nothing): the Triton kernel puts its row's columns in
        that order before it stores them, the same values."""
        self.out_perm = perm.to(torch.int32)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x: [T, D]; with residual returns (normed, x + residual); normed is an FP8Activation
        # (Int8Activation) where fp8_out (int8_out) and the consumer takes one
        if self.reduces_input:
            fused = fused_norm_for(x, self)
            if fused is not None:     # the row-parallel layer left x unreduced
                return fused(x, residual, self.weight, self.eps, self.reduce_site % 2,
                             was_pushed(x))
        if self.fp8_out and takes_fp8_activation(x):
            from kvfleet_kernels.norm import rms_norm_fp8
            q, scale, summed = rms_norm_fp8(x, self.weight, self.eps, residual)
            out = FP8Activation(q, scale, x.dtype)
            return out if residual is None else (out, summed)
        if self.int8_out and takes_fp8_activation(x):
            from kvfleet_kernels.norm import rms_norm_int8
            q, scale, summed = rms_norm_int8(x, self.weight, self.eps, residual)
            out = Int8Activation(q, scale, x.dtype)
            return out if residual is None else (out, summed)
        if use_triton(x):
            from kvfleet_kernels.norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, self.out_perm)
        out = rms_norm_torch(x, self.weight, self.eps, residual)
        if self.out_perm is None:
            return out
        return out[:, self.out_perm] if residual is None else (out[0][:, self.out_perm], out[1])


def reduce_in_norm(layer: nn.Module, norm: RMSNorm, site: int) -> None:
    """`norm` is the only reader of row-parallel `layer`'s output (decoder: o_proj ->
    post_attention_layernorm, down_proj -> the next input_layernorm or the final norm): where
    the fused all-reduce + RMSNorm serves a step (distributed.communication.fused_norm_for),
    the layer skips its all-reduce and the norm does it. `site`: the pair's place in the
    forward pass, 0, 1, 2, ... in call order, an even number of them in all; its parity picks
    the buffer slot, so consecutive calls (across forward passes too) alternate slots as the
    kernel requires (kvfleet_kernels.all_reduce). No-op without tensor parallelism."""
    if getattr(layer, "parallel", None) == "row":
        layer.reduced_by = [norm]       # a list: not registered as a submodule
        norm.reduces_input = True
        norm.reduce_site = site
