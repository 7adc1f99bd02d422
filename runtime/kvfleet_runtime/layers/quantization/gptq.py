"""GPTQ checkpoints: config, tensors, pack and unpack.

Tensors of one projection with K inputs, N outputs, G groups, P = 32 // bits values per int32:
  qweight [K // P, N] int32  packed along the input dim, natural order
  qzeros  [G, N // P] int32  packed along the output dim; checkpoint_format "gptq" (v1)
                             stores zero - 1 (so a zero point of 0 cannot be written),
                             "gptq_v2" the zero point itself
  scales  [G, N] fp16
  g_idx   [K] int32          group of each input row; with desc_act (act-order) a shuffle
                             (so a row-parallel rank keeps all groups: see int_weight.py)
w[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from kvfleet_runtime.layers.linear import Linear, LinearMethod, set_weight_attrs
from kvfleet_runtime.layers.quantization.base import (
    QuantConfig,
    read_bool,
    read_choice,
    read_not_convert,
)
from kvfleet_runtime.layers.quantization.int_weight import (
    GroupSplit,
    IntWeight,
    IntWeightMethod,
    check_divisible,
    default_g_idx,
    split_groups,
)
from kvfleet_runtime.layers.quantization.packing import pack_int32, unpack_int32

ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              bits: int, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Checkpoint tensors of integer weights q [K, N] with zero points [G, N] (our packer)."""
    offset = ZERO_OFFSET[checkpoint_format]
    if offset and int(zeros.min()) < offset:
        raise ValueError("GPTQ v1 (checkpoint_format 'gptq') stores zero - 1 and cannot hold a "
                         f"zero point of 0; zero points must be in 1..{(1 << bits) - 1}")
    return {"qweight": pack_int32(q, bits, dim=0),
            "qzeros": pack_int32(zeros.to(torch.int64) - offset, bits, dim=1),
            "scales": scales.to(torch.float16),
            "g_idx": g_idx.to(torch.int32)}


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int, checkpoint_format: str = "gptq") -> IntWeight:
    return IntWeight(q=unpack_int32(qweight, bits, dim=0),
                     zeros=(unpack_int32(qzeros, bits, dim=1) + ZERO_OFFSET[checkpoint_format]).float(),
                     scales=scales, g_idx=g_idx, bits=bits)


def load_g_idx(layer: Linear, split: GroupSplit, param: torch.Tensor, loaded: torch.Tensor,
                shard_id: int | None) -> None:
    # this rank's input rows, numbered like the groups of scales it holds (on the param's
    # device: checkpoints are read to the CPU, and fused shards' g_idx are compared below)
    loaded = layer.rank_part(param, loaded, shard_id).to(param.device, param.dtype) \
        - split.first_group
    if param.shape != loaded.shape:
        raise ValueError(f"{layer.prefix}: g_idx of shape {tuple(loaded.shape)} does not fit "
                         f"{tuple(param.shape)}")
    if loaded.numel() and (int(loaded.min()) < 0 or int(loaded.max()) >= split.num_groups):
        first, last = split.first_group, split.first_group + split.num_groups - 1
        raise ValueError(f"{layer.prefix}: g_idx of this rank's input rows names groups "
                         f"{int(loaded.min()) + first}..{int(loaded.max()) + first}, outside its "
                         f"groups {first}..{last}; a shuffled (act-order) g_idx needs act-order "
                         "in the quantization_config (GPTQ's desc_act true, compressed-tensors' "
                         "actorder group)")
    # fused shards share their input, so their act-order (hence g_idx) must be one
    if getattr(param, "is_loaded", False) and not torch.equal(param.data, loaded):
        raise ValueError(f"g_idx of shard {shard_id} differs from another shard's; fused "
                         "projections (q/k/v, gate/up) must share one act-order")
    param.data.copy_(loaded)
    param.is_loaded = True


class GPTQLinearMethod(IntWeightMethod):
    name = "gptq"
    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int, checkpoint_format: str,
                 desc_act: bool = False) -> None:
        super().__init__(bits, group_size)
        self.checkpoint_format = checkpoint_format
        self.desc_act = desc_act

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        per_word = 32 // self.bits
        check_divisible(layer, "input size", input_size, per_word, self.name)
        for size in output_sizes:
            check_divisible(layer, "output size", size, per_word, self.name)
        split = split_groups(layer, self.group_size, self.desc_act, self.name)
        n, g = sum(output_sizes), split.num_groups
        # checkpoints without g_idx mean the plain grouping
        g_idx = default_g_idx(input_size, self.group_size, layer.input_start) - split.first_group
        params = {
            "qweight": (torch.empty(input_size // per_word, n, dtype=torch.int32),
                        {"output_dim": 1, "input_dim": 0, "input_pack": per_word}),
            "qzeros": (torch.empty(g, n // per_word, dtype=torch.int32),
                       {"output_dim": 1, "output_pack": per_word, **split.attrs}),
            "scales": (torch.empty(g, n, dtype=torch.float16), {"output_dim": 1, **split.attrs}),
            "g_idx": (g_idx, {"input_dim": 0, "optional": True,
                              "weight_loader": partial(load_g_idx, layer, split)}),
        }
        for name, (tensor, attrs) in params.items():
            param = nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(param, **attrs)
            layer.register_parameter(name, param)

    def unpack(self, layer: Linear) -> IntWeight:
        return unpack_gptq(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, self.bits,
                           self.checkpoint_format)


@dataclass
class GPTQConfig(QuantConfig):
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False       # act-order; the g_idx tensors carry its effect
    sym: bool = True             # zero points are read from qzeros either way
    checkpoint_format: str = "gptq"

    name = "gptq"

    @classmethod
    def from_config(cls, raw: dict) -> GPTQConfig:
        group_size = raw.get("group_size", 128)
        if not isinstance(group_size, int) or isinstance(group_size, bool) or not (
                group_size == -1 or group_size > 0):
            raise ValueError("gptq quantization_config.group_size must be -1 or a positive "
                             f"integer (32, 64, 128, ...); got {group_size!r}")
        if raw.get("lm_head", False):
            raise ValueError("gptq quantization_config.lm_head must be false: kvfleet keeps "
                             "lm_head unquantized")
        return cls(bits=read_choice(raw, ("bits",), 4, (4, 8), "gptq"),
                   group_size=group_size,
                   desc_act=read_bool(raw, "desc_act", False, "gptq"),
                   sym=read_bool(raw, "sym", True, "gptq"),
                   checkpoint_format=read_choice(raw, ("checkpoint_format",), "gptq",
                                                 tuple(ZERO_OFFSET), "gptq"),
                   modules_to_not_convert=read_not_convert(raw))

    def create_method(self) -> LinearMethod:
        return GPTQLinearMethod(self.bits, self.group_size, self.checkpoint_format,
                                self.desc_act)
