"""FP8 (e4m3) weights: read from an fp8 checkpoint or quantized on load from fp16/bf16.

Checkpoint tensors: `weight` float8_e4m3fn [N, K] and `weight_scale` fp32, per tensor (one
number per checkpoint module, so a fused layer gets one per shard) or per output channel.
Both are kept as one per-channel scale [N]: a per-tensor scale repeated over its shard's rows
is exact, and needs no requantization of fused shards. Quantizing on load rounds each
checkpoint tensor as it arrives, per output row, before the loader keeps this rank's part:
a row-parallel rank then gets the scales of whole rows, the same as with one rank.
Activations are scaled per token at run time (activation_scheme "dynamic"). Without an
FP8-capable GPU the weight is dequantized on load into the model's dtype.

Block-wise checkpoints (`weight_block_size` [bn, bk]: Qwen3-*-FP8, DeepSeek's): `weight` e4m3 and
`weight_scale_inv` fp32 [N / bn, K / bk], a scale a block, sharded along both dims like the
weight (in block units). Once loaded the weight is dequantized by its blocks and requantized a
row at a time for the per-channel FP8 GEMM (one more rounding, within a row's range; without an
FP8 GPU the block dequantization is kept, exactly the checkpoint's values).

A layer's input may arrive already quantized: an `FP8Activation` from the RMSNorm or SiluAndMul
in front of it (one kernel writes the e4m3 activation and its scales instead of a bf16 one the
GEMM quantizes again). The model links producer and consumer (`feeds_fp8`); the consumer's
process_weights_after_loading turns the producer's `fp8_out` on where the FP8 GEMM runs, and
the producer quantizes only the inputs that go to it (`takes_fp8_activation`: not batch 1).
W8A8 int8 layers (compressed_tensors.CTInt8LinearMethod) take the same link: their producers'
`int8_out` makes them hand over an `Int8Activation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from kvfleet_kernels.fp8 import FP8, fp8_linear, fp8_supported, quantize_fp8_rowwise
from torch import nn

from kvfleet_runtime.layers import linear
from kvfleet_runtime.layers.backend import use_triton
from kvfleet_runtime.layers.linear import Linear, LinearMethod, set_weight_attrs
from kvfleet_runtime.layers.quantization.base import (
    QuantConfig,
    log_once,
    read_choice,
    read_not_convert,
)


class FP8Activation(NamedTuple):
    """A GEMM input quantized per token, as fp8_linear would quantize it itself."""
    q: torch.Tensor          # [T, K] e4m3
    scale: torch.Tensor      # [T, 1] fp32
    dtype: torch.dtype       # the unquantized activation's: the GEMM's output dtype


class Int8Activation(NamedTuple):
    """A W8A8 GEMM input quantized per token, as int8_linear would quantize it itself."""
    q: torch.Tensor          # [T, K] int8
    scale: torch.Tensor      # [T, 1] fp32
    dtype: torch.dtype       # the unquantized activation's: the GEMM's output dtype


def batch_one_fp8_gemv(x: torch.Tensor) -> bool:
    """FP8 weights meet x in the W8A16 GEMV (batch 1), which takes x unquantized."""
    return linear._FP8_GEMV and linear.batch_one_gemv(x)


def takes_fp8_activation(x: torch.Tensor) -> bool:
    """An FP8 (or W8A8 int8) GEMM fed rows like x's (same count, device) quantizes them first,
    so a producer linked by feeds_fp8 may hand them over quantized (in its Triton kernel)."""
    return use_triton(x) and not batch_one_fp8_gemv(x)


def feeds_fp8(producer: nn.Module, consumer: Linear) -> None:
    """producer (whose `fp8_out` flag says it returns an FP8Activation where
    takes_fp8_activation, `int8_out` an Int8Activation) computes consumer's input: the flag is
    set once consumer's weights are processed, if they run on the FP8 GEMM (uses_fp8) or the
    W8A8 int8 GEMM (uses_int8)."""
    # a tuple, not an attribute holding the module: that would make it consumer's submodule
    consumer.fp8_input_producers = (*getattr(consumer, "fp8_input_producers", ()), producer)


def load_row_scale(layer: Linear, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: int | None) -> None:
    """A per-tensor (one number a checkpoint piece) or per-channel value of each output row
    into `param` [N] (FP8 scales; compressed-tensors int8 scales and zero points)."""
    if loaded.numel() == 1:
        # per tensor: this rank's rows of the piece all get it
        if shard_id is None:
            offset, size = 0, layer.output_size
        else:
            offset, size = sum(layer.output_sizes[:shard_id]), layer.output_sizes[shard_id]
        param.data.narrow(0, offset, size).fill_(loaded.reshape(()).item())
        return
    full = sum(layer.full_output_sizes) if shard_id is None else layer.full_output_sizes[shard_id]
    if loaded.numel() != full:
        raise ValueError(f"{layer.prefix}: weight_scale of shape {tuple(loaded.shape)} is "
                         f"neither per-tensor (1 value) nor per-channel ({full} values)")
    layer.place(param, loaded.reshape(full), shard_id)


def dequantize_blocks(name: str, weight: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled e4m3 weight [N, K] in fp32: each [bn, bk] block times its scale in
    weight_scale_inv [cdiv(N, bn), cdiv(K, bk)] (name: for the error of a mismatched grid)."""
    bn, bk = block
    rows, cols = weight.shape
    if scale.shape != (-(-rows // bn), -(-cols // bk)):
        raise ValueError(f"{name}: weight_scale_inv of shape {tuple(scale.shape)} does not hold "
                         f"a scale a [{bn}, {bk}] block of a {rows} x {cols} weight")
    full = scale.float().repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    return weight.float() * full


def dequantize_fp8(name: str, weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """An e4m3 weight [N, K] in fp32: times its block scales (`block`), or its scale a row
    ([N] / [N, 1]) or a tensor (one number)."""
    if block is not None:
        return dequantize_blocks(name, weight, scale, block)
    if scale.numel() not in (1, weight.shape[0]):
        raise ValueError(f"{name}: weight_scale of shape {tuple(scale.shape)} is neither per "
                         f"tensor nor per channel of a {tuple(weight.shape)} weight")
    return weight.float() * scale.float().reshape(-1, 1)


def _quantize_on_load(layer: Linear, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | None) -> None:
    # rounded in the model's dtype first: what the layer would hold unquantized
    w8, scale = quantize_fp8_rowwise(loaded.to(param.device, layer.params_dtype))
    layer.place(param, w8, shard_id)
    layer.place(layer.weight_scale, scale.reshape(-1), shard_id)


class FP8LinearMethod(LinearMethod):
    def __init__(self, serialized: bool, block: tuple[int, int] | None = None) -> None:
        self.serialized = serialized
        self.block = block

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        n = sum(output_sizes)
        weight = nn.Parameter(torch.empty(n, input_size, dtype=FP8), requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)
        # ones: what a dummy load (random weights, no checkpoint) leaves in place
        scale = torch.ones(n, dtype=torch.float32)
        if self.block is not None:
            bn, bk = self.block
            if any(size % bn for size in output_sizes) or input_size % bk:
                raise ValueError(f"{layer.prefix}: fp8 weight_block_size {list(self.block)} "
                                 f"does not divide its shape (outputs {output_sizes}, inputs "
                                 f"{input_size} on this rank)")
            blocks = nn.Parameter(torch.ones(n // bn, input_size // bk), requires_grad=False)
            set_weight_attrs(blocks, output_dim=0, input_dim=1, output_pack=bn, input_pack=bk)
            layer.register_parameter("weight_scale_inv", blocks)
            layer.register_buffer("weight_scale", scale, persistent=False)
        elif self.serialized:
            scale = nn.Parameter(scale, requires_grad=False)
            set_weight_attrs(scale, weight_loader=partial(load_row_scale, layer))
            layer.register_parameter("weight_scale", scale)
        else:
            # not a checkpoint tensor: each weight's rounding fills it
            set_weight_attrs(weight, weight_loader=partial(_quantize_on_load, layer))
            layer.register_buffer("weight_scale", scale, persistent=False)
        set_weight_attrs(scale, output_dim=0)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.block is not None and self._from_blocks(layer):
            return
        weight, scale = layer.weight.data, layer.weight_scale.data
        delattr(layer, "weight_scale")
        delattr(layer, "weight")
        n, k = weight.shape
        layer.uses_fp8 = fp8_supported(weight.device) and n % 16 == 0 and k % 16 == 0
        for producer in getattr(layer, "fp8_input_producers", ()):
            producer.fp8_out = layer.uses_fp8
        if layer.uses_fp8:
            layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
            layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))
            return
        log_once("fp8: no FP8 GEMM here (needs a GPU of compute capability >= 8.9 and sizes "
                 "that are multiples of 16); such layers are dequantized on load")
        dequantized = (weight.float() * scale[:, None]).to(layer.params_dtype)
        layer.register_parameter("weight", nn.Parameter(dequantized, requires_grad=False))

    def _from_blocks(self, layer: Linear) -> bool:
        """A block-scaled weight as per-channel e4m3 for the FP8 GEMM; without an FP8 GPU the
        block dequantization itself in the model's dtype (True: the layer is done)."""
        exact = dequantize_blocks(layer.prefix, layer.weight.data, layer.weight_scale_inv.data,
                                  self.block)
        delattr(layer, "weight_scale_inv")
        if fp8_supported(exact.device):
            w8, scale = quantize_fp8_rowwise(exact)
            layer.weight.data = w8
            layer.weight_scale.data = scale.reshape(-1)
            return False
        log_once("fp8: no FP8 GEMM here (needs a GPU of compute capability >= 8.9); block-scaled "
                 "weights are dequantized on load")
        delattr(layer, "weight")
        delattr(layer, "weight_scale")
        layer.uses_fp8 = False
        for producer in getattr(layer, "fp8_input_producers", ()):
            producer.fp8_out = False
        layer.register_parameter("weight", nn.Parameter(exact.to(layer.params_dtype),
                                                        requires_grad=False))
        return True

    def apply(self, layer: Linear, x: torch.Tensor | FP8Activation,
              bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, FP8Activation):      # only a producer with fp8_out, so uses_fp8
            return fp8_linear(x.q, layer.weight, layer.weight_scale, bias, x_scale=x.scale,
                              out_dtype=x.dtype)
        if layer.uses_fp8:
            if batch_one_fp8_gemv(x):
                # batch 1: W8A16 GEMV, the activation left unquantized (KVFLEET_TRITON_GEMV=0: off)
                from kvfleet_kernels.gemv import gemv
                return gemv(x, layer.weight, bias, scale=layer.weight_scale)
            return fp8_linear(x, layer.weight, layer.weight_scale, bias)
        return F.linear(x, layer.weight, bias)


@dataclass
class FP8Config(QuantConfig):
    serialized: bool = True     # False: an fp16/bf16 checkpoint quantized on load
    block: tuple[int, int] | None = None    # weight_block_size: a scale a [bn, bk] block

    name = "fp8"

    @classmethod
    def from_config(cls, raw: dict) -> FP8Config:
        read_choice(raw, ("activation_scheme",), "dynamic", ("dynamic",), "fp8")
        block = raw.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2 or not all(
                isinstance(b, int) and b > 0 for b in block)):
            raise ValueError("fp8 quantization_config.weight_block_size must be two positive "
                             f"integers [rows, columns] or null; got {block!r}")
        return cls(serialized=True, modules_to_not_convert=read_not_convert(raw),
                   block=tuple(block) if block else None)

    def create_method(self) -> LinearMethod:
        return FP8LinearMethod(self.serialized, self.block)
