"""Linear layers whose weights are created and applied by a pluggable LinearMethod.

One `Linear` serves plain and fused projections (qkv, gate_up): `output_sizes`
lists the pieces; checkpoint tensors of piece i are loaded with `shard_id=i`.
A quantization method (layers/quantization/) registers its own parameters
(qweight, scales, ...) and tags each with:
  output_dim:  which dim runs along the output features (None: not sharded by output)
  output_pack: how many output features one element holds along output_dim (packed ints)
so the shared `weight_loader` places each piece at its offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """Unquantized weights: [out_features, in_features] in the compute dtype."""

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype),
                              requires_grad=False)
        set_weight_attrs(weight, output_dim=0)
        layer.register_parameter("weight", weight)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass


def set_weight_attrs(param: torch.Tensor, **attrs: object) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


class Linear(nn.Module):
    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool = False,
                 dtype: torch.dtype | None = None, linear_method: LinearMethod | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.prefix = prefix
        dtype = dtype or torch.get_default_dtype()
        self.params_dtype = dtype
        self.linear_method = linear_method or LinearMethod()
        self.linear_method.create_weights(self, input_size, self.output_sizes, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return self.linear_method.apply(self, x, self.bias)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        custom = getattr(param, "weight_loader", None)
        if custom is not None:
            custom(param, loaded, shard_id)
            return
        output_dim = getattr(param, "output_dim", None)
        if shard_id is None or output_dim is None:
            if param.shape != loaded.shape:
                raise ValueError(f"{self.prefix}: checkpoint tensor of shape {tuple(loaded.shape)} "
                                 f"does not fit parameter of shape {tuple(param.shape)}")
            param.data.copy_(loaded)
            return
        pack = getattr(param, "output_pack", 1)
        offset = sum(self.output_sizes[:shard_id]) // pack
        size = self.output_sizes[shard_id] // pack
        target = param.data.narrow(output_dim, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"{self.prefix} shard {shard_id}: checkpoint tensor of shape "
                             f"{tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, "
                f"method={type(self.linear_method).__name__}")
