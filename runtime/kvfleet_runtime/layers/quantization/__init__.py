"""Quantized weights: GPTQ and AWQ (4/8-bit integer, fused W4A16 kernel), FP8 (e4m3), and
compressed-tensors and NVIDIA ModelOpt checkpoints.

`get_quant_config` reads the checkpoint's scheme (config.json's quantization_config, else
quantize_config.json / quant_config.json beside it) and reconciles it with the user's
`--quantization`; the config then gives each Linear its LinearMethod (or None: unquantized).
"""

from __future__ import annotations

import json
import os

from kvfleet_runtime.layers.quantization.awq import AWQConfig
from kvfleet_runtime.layers.quantization.base import QuantConfig
from kvfleet_runtime.layers.quantization.compressed_tensors import CompressedTensorsConfig
from kvfleet_runtime.layers.quantization.fp8 import FP8Config
from kvfleet_runtime.layers.quantization.gptq import GPTQConfig
from kvfleet_runtime.layers.quantization.modelopt import ModelOptConfig

CONFIGS: dict[str, type[QuantConfig]] = {
    "gptq": GPTQConfig, "awq": AWQConfig, "fp8": FP8Config,
    "compressed-tensors": CompressedTensorsConfig, "modelopt": ModelOptConfig}
# standalone files written by AutoGPTQ/GPTQModel, AutoAWQ and NVIDIA ModelOpt, with the method
# they imply
SIDE_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"),
              ("hf_quant_config.json", "modelopt"))

__all__ = ["AWQConfig", "CompressedTensorsConfig", "FP8Config", "GPTQConfig", "ModelOptConfig",
           "QuantConfig", "get_quant_config"]


def _checkpoint_scheme(hf_config: dict, model_dir: str | None) -> tuple[dict, str, str] | None:
    """(raw config, method, where it was found) of the checkpoint, or None if unquantized."""
    raw = hf_config.get("quantization_config")
    if raw is not None:
        return raw, raw.get("quant_method", ""), "config.json quantization_config"
    for name, implied in SIDE_FILES:
        path = os.path.join(model_dir, name) if model_dir else None
        if path and os.path.isfile(path):
            with open(path) as f:
                raw = json.load(f)
            return raw, raw.get("quant_method", implied), name
    return None


def get_quant_config(hf_config: dict, model_dir: str | None,
                     requested: str | None) -> QuantConfig | None:
    """The checkpoint's quantization, checked against `requested` (None, gptq, awq, fp8,
    compressed-tensors)."""
    if requested is not None and requested not in CONFIGS:
        raise ValueError(f"quantization must be one of {', '.join(CONFIGS)}; got {requested!r}")
    found = _checkpoint_scheme(hf_config, model_dir)
    if found is None:
        if requested is None:
            return None
        if requested == "fp8":
            return FP8Config(serialized=False)
        raise ValueError(f"quantization {requested!r} needs a {requested} checkpoint, but "
                         f"{model_dir or 'the model'} has no quantization_config in config.json "
                         "nor a quantize_config.json; only fp8 can quantize an unquantized model "
                         "on load")
    raw, method, where = found
    method = str(method).lower()
    if method not in CONFIGS:
        raise ValueError(f"{where}: quant_method must be one of {', '.join(CONFIGS)}; "
                         f"got {method!r}")
    if requested is not None and requested != method:
        raise ValueError(f"quantization {requested!r} was requested but the checkpoint is "
                         f"quantized with {method!r} ({where}); drop --quantization or pass "
                         f"--quantization {method}")
    return CONFIGS[method].from_config(raw)
