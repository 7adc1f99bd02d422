"""AWQ checkpoints (GEMM version): config, tensors, pack and unpack.

Tensors of one projection with K inputs, N outputs, G = K // group_size groups:
  qweight [K, N // 8] int32  packed along the output dim in AWQ_ORDER
  qzeros  [G, N // 8] int32  same packing; the zero point itself
  scales  [G, N] fp16
w[k, n] = (q[k, n] - zero[k // group_size, n]) * scales[k // group_size, n].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvfleet_runtime.layers.linear import Linear, LinearMethod, set_weight_attrs
from kvfleet_runtime.layers.quantization.base import QuantConfig, read_choice, read_not_convert
from kvfleet_runtime.layers.quantization.int_weight import (
    IntWeight,
    IntWeightMethod,
    check_divisible,
    default_g_idx,
    split_groups,
)
from kvfleet_runtime.layers.quantization.packing import AWQ_ORDER, pack_int32, unpack_int32

BITS = 4
PER_WORD = 32 // BITS


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of 4-bit weights q [K, N] with zero points [G, N] (our packer)."""
    return {"qweight": pack_int32(q, BITS, dim=1, order=AWQ_ORDER),
            "qzeros": pack_int32(zeros.to(torch.int64), BITS, dim=1, order=AWQ_ORDER),
            "scales": scales.to(torch.float16)}


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> IntWeight:
    q = unpack_int32(qweight, BITS, dim=1, order=AWQ_ORDER)
    return IntWeight(q=q, zeros=unpack_int32(qzeros, BITS, dim=1, order=AWQ_ORDER).float(),
                     scales=scales, g_idx=default_g_idx(q.shape[0], group_size).to(q.device),
                     bits=BITS)


class AWQLinearMethod(IntWeightMethod):
    name = "awq"
    checkpoint_params = ("qweight", "qzeros", "scales")

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        split = split_groups(layer, self.group_size, act_order=False, method=self.name)
        check_divisible(layer, "input size", input_size, self.group_size, self.name)
        for size in output_sizes:
            check_divisible(layer, "output size", size, PER_WORD, self.name)
        n, g = sum(output_sizes), split.num_groups
        packed = {"output_dim": 1, "output_pack": PER_WORD}
        params = {"qweight": (torch.empty(input_size, n // PER_WORD, dtype=torch.int32),
                              {**packed, "input_dim": 0}),
                  "qzeros": (torch.empty(g, n // PER_WORD, dtype=torch.int32),
                             {**packed, **split.attrs}),
                  "scales": (torch.empty(g, n, dtype=torch.float16),
                             {"output_dim": 1, **split.attrs})}
        for name, (tensor, attrs) in params.items():
            param = nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(param, **attrs)
            layer.register_parameter(name, param)

    def unpack(self, layer: Linear) -> IntWeight:
        return unpack_awq(layer.qweight, layer.qzeros, layer.scales, self.group_size)


@dataclass
class AWQConfig(QuantConfig):
    group_size: int = 128

    name = "awq"

    @classmethod
    def from_config(cls, raw: dict) -> AWQConfig:
        # HF writes bits/group_size/version, AutoAWQ's quant_config.json w_bit/q_group_size
        read_choice(raw, ("bits", "w_bit"), 4, (4,), "awq")
        read_choice(raw, ("version",), "gemm", ("gemm",), "awq")
        read_choice(raw, ("zero_point",), True, (True,), "awq")
        key = "group_size" if "group_size" in raw else "q_group_size"
        group_size = raw.get(key, 128)
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise ValueError(f"awq quantization_config.{key} must be a positive integer "
                             f"(32, 64, 128, ...); got {group_size!r}")
        return cls(group_size=group_size, modules_to_not_convert=read_not_convert(raw))

    def create_method(self) -> LinearMethod:
        return AWQLinearMethod(BITS, self.group_size)
