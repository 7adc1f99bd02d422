"""NVIDIA ModelOpt checkpoints (`quant_method: modelopt` in config.json's quantization_config, or
an `hf_quant_config.json` beside it: `{"quantization": {"quant_algo": ...}}`), read as stored.

  FP8                          `weight` [N, K] e4m3, `weight_scale` one a checkpoint piece
                               (per tensor), `input_scale` (static activations): the FP8
                               method (fp8.py), each row its piece's scale; the static input
                               scale read past, activations scaled per token (as for
                               compressed-tensors FP8).
  FP8_PER_CHANNEL_PER_TOKEN    the same with `weight_scale` [N] (a row each).
  NVFP4                        `weight` [N, K / 2] uint8 (two e2m1 values a byte, the low
                               nibble first), `weight_scale` [N, K / 16] e4m3, `weight_scale_2`
                               one fp32 a piece: w = e2m1 * weight_scale * weight_scale_2 (the
                               inverse of compressed-tensors' global scale), `input_scale`
                               (W4A4's activations) read past: compressed_tensors.unpack_fp4's
                               8-bit integers on the integer kernels.

`exclude_modules` (names or fnmatch patterns, e.g. `lm_head`, `model.layers.0.*`) stay in the
model's dtype. `kv_cache_quant_algo: FP8`: calibrated `self_attn.k_proj.k_scale` /
`v_proj.v_scale` (loader.KVScales) for an fp8 KV cache. Mixtures of experts (models/moe.py):
FP8 experts are dequantized as they load and rounded a row at a time (as FP8 checkpoints'
experts are), NVFP4 ones kept packed as 8-bit integers (layers.moe's IntExperts), experts that
exclude_modules names stay in the model's dtype (all of them or none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch

from kvfleet_runtime.layers.linear import Linear, LinearMethod
from kvfleet_runtime.layers.quantization.base import (
    NEVER_QUANTIZED,
    QuantConfig,
    log_once,
    matches_module,
    read_choice,
    shard_prefixes,
)
from kvfleet_runtime.layers.quantization.compressed_tensors import (
    fp4_params,
    read_past,
    register_params,
    unpack_fp4,
)
from kvfleet_runtime.layers.quantization.fp8 import FP8LinearMethod
from kvfleet_runtime.layers.quantization.int_weight import (
    IntWeight,
    IntWeightMethod,
)

NAME = "modelopt"
ALGOS = ("fp8", "fp8_per_channel_per_token", "nvfp4")
NVFP4_GROUP = 16


_read_past = read_past(f"{NAME}: the checkpoint's static activation scales (input_scale) are "
                       "not used: activations are scaled per token (FP8) or stay unquantized "
                       "(NVFP4)")


def _input_scale() -> dict:
    return {"input_scale": (torch.ones(1), {"optional": True, "weight_loader": _read_past})}


class ModelOptFP8Method(FP8LinearMethod):
    """FP8 weights a scale a piece (or a row); the static input_scale read past."""

    def __init__(self) -> None:
        super().__init__(serialized=True)

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_sizes, dtype)
        register_params(layer, _input_scale())

    def process_weights_after_loading(self, layer: Linear) -> None:
        del layer.input_scale
        super().process_weights_after_loading(layer)


class ModelOptFP4Method(IntWeightMethod):
    """NVFP4 weights as unpack_fp4's 8-bit integers (weight_scale * weight_scale_2 a group)."""
    name = NAME

    def __init__(self) -> None:
        super().__init__(8, NVFP4_GROUP)

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        params = {**fp4_params(layer, input_size, output_sizes, NVFP4_GROUP, NAME, "weight",
                               torch.float8_e4m3fn, "weight_scale_2"), **_input_scale()}
        self.checkpoint_params = tuple(register_params(layer, params))

    def unpack(self, layer: Linear) -> IntWeight:
        return unpack_fp4(layer.weight.data, layer.weight_scale.data, None, NVFP4_GROUP,
                          scale_2=layer.weight_scale_2.data)


@dataclass
class ModelOptConfig(QuantConfig):
    algo: str = "fp8"
    exclude: list[str] = field(default_factory=list)
    experts_excluded: bool = False      # a mixture of experts' experts (set by models/moe.py)

    name = NAME

    @classmethod
    def from_config(cls, raw: dict) -> ModelOptConfig:
        q = raw.get("quantization", raw)       # hf_quant_config.json nests it
        algo = read_choice(q, ("quant_algo",), None, ALGOS, NAME)
        read_choice(q, ("kv_cache_quant_algo",), None, (None, "fp8"), NAME)
        if algo == "nvfp4":
            read_choice(q, ("group_size",), NVFP4_GROUP, (NVFP4_GROUP,), NAME)
        exclude = q.get("exclude_modules") or []
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise ValueError(f"{NAME} quantization_config.exclude_modules must be a list of "
                             f"module names or patterns; got {exclude!r}")
        if algo == "nvfp4":
            log_once(f"{NAME}: NVFP4 weights run as 8-bit integers on the integer kernels "
                     "(Hopper has no FP4 tensor cores); their FP4 activations stay unquantized")
        return cls(algo=algo, exclude=list(exclude))

    def excluded(self, module: str) -> bool:
        return any(fnmatchcase(module, e) or matches_module(module, e) for e in self.exclude)

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        if prefix.rpartition(".")[2] in NEVER_QUANTIZED:
            return None
        excluded = [self.excluded(s) for s in shard_prefixes(prefix)]
        if any(excluded):
            if not all(excluded):
                raise ValueError(f"{NAME}: exclude_modules names some shards of the fused layer "
                                 f"{prefix} but not all; they must be quantized alike")
            log_once(f"{NAME}: {prefix} stays unquantized (exclude_modules), in the model's "
                     "dtype")
            return None
        return ModelOptFP4Method() if self.algo == "nvfp4" else ModelOptFP8Method()
