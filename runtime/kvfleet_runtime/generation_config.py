"""A model's generation_config.json as sampling defaults (vLLM's `--generation-config auto`):
the knobs a request leaves unset take the model's recommended values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# the knobs a request leaves unset (null or absent) that a model's generation_config.json may
# set, as vLLM takes them; with its transformers default, a value there sets nothing
SAMPLING_DEFAULT_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                           "repetition_penalty": 1.0, "max_new_tokens": None}


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a model's generation_config.json sets (vLLM's rule: the
    keys that differ from transformers' defaults), max_new_tokens as max_tokens."""
    out = {}
    for key, hf_default in _HF_GENERATION_DEFAULTS.items():
        value = generation_config.get(key)
        if value is not None and value != hf_default:
            out["max_tokens" if key == "max_new_tokens" else key] = value
    return out


def load_sampling_defaults(value: str, model: str) -> dict[str, Any]:
    """The sampling defaults of `value`: "auto" (the model folder's generation_config.json,
    none for a .gguf or a folder without one), "vllm" (none) or a folder holding the file;
    ValueError for a folder without it or a file that is not JSON."""
    if value == "vllm":
        return {}
    path = Path(model if value == "auto" else value) / "generation_config.json"
    if not path.is_file():
        if value == "auto":
            return {}
        raise ValueError(f"--generation-config: no generation_config.json in {value!r}")
    try:
        return generation_defaults(json.loads(path.read_text()))
    except ValueError as e:
        raise ValueError(f"--generation-config: {path} is not valid JSON: {e}") from None
