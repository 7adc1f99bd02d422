"""QuantConfig: one checkpoint's quantization scheme, and which layers it leaves alone.

A config hands each Linear (by its prefix, e.g. "model.layers.0.self_attn.qkv_proj") a
LinearMethod, or None when the layer stays unquantized: lm_head, and whatever the checkpoint
lists in modules_to_not_convert. A fused layer (qkv_proj, gate_up_proj) is judged by the
checkpoint names of its shards (q_proj, k_proj, v_proj), which must agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvfleet_runtime.layers.linear import LinearMethod

logger = logging.getLogger(__name__)
_logged: set[str] = set()

# fused layer name -> checkpoint names of its shards, in shard_id order
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                "gate_up_proj": ("gate_proj", "up_proj")}
NEVER_QUANTIZED = ("lm_head",)


def shard_prefixes(prefix: str) -> list[str]:
    """Checkpoint module names behind one Linear's prefix."""
    parent, _, name = prefix.rpartition(".")
    shards = FUSED_SHARDS.get(name)
    if shards is None:
        return [prefix]
    return [f"{parent}.{s}" if parent else s for s in shards]


def matches_module(prefix: str, pattern: str) -> bool:
    """Whether `pattern` ("lm_head", "mlp.down_proj", "model.layers.3") names `prefix` or a parent
    of it, compared by whole dotted components."""
    parts, wanted = prefix.split("."), pattern.split(".")
    return any(parts[i:i + len(wanted)] == wanted for i in range(len(parts) - len(wanted) + 1))


@dataclass
class QuantConfig:
    """Base of GPTQConfig, AWQConfig, FP8Config."""
    modules_to_not_convert: list[str] = field(default_factory=list)

    name = "none"

    def create_method(self) -> LinearMethod:
        raise NotImplementedError

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        """The method for the Linear at `prefix`; None keeps it in the model's dtype."""
        reason = self._skip_reason(prefix)
        if reason is None:
            return self.create_method()
        log_once(f"{self.name}: {prefix} stays unquantized ({reason}), in the model's dtype")
        return None

    def _skip_reason(self, prefix: str) -> str | None:
        if prefix.rpartition(".")[2] in NEVER_QUANTIZED:
            return "lm_head is never quantized"
        shards = shard_prefixes(prefix)
        skipped = [any(matches_module(s, p) for p in self.modules_to_not_convert) for s in shards]
        if all(skipped):
            return "modules_to_not_convert"
        if any(skipped):
            listed = [s for s, skip in zip(shards, skipped, strict=True) if skip]
            raise ValueError(f"{self.name}: modules_to_not_convert lists {listed} but not the other "
                             f"shards of the fused layer {prefix}; its shards must all be "
                             "quantized or all be left unquantized")
        return None


def log_once(message: str) -> None:
    """One log line per distinct message: a fallback applies to many layers alike."""
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def read_bool(raw: dict, key: str, default: bool, method: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{method} quantization_config.{key} must be true or false; got {value!r}")
    return value


def read_choice(raw: dict, keys: tuple[str, ...], default: object, allowed: tuple,
                method: str, path: str = "") -> object:
    """The first of `keys` present in `raw` (checkpoints spell some fields two ways), checked;
    `path`: where `raw` sits in the quantization_config, for the error ("config_groups.g.")."""
    key = next((k for k in keys if k in raw), keys[0])
    value = raw.get(key, default)
    if isinstance(value, str):
        value = value.lower()
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise ValueError(f"{method} quantization_config.{path}{key} must be one of {shown}; "
                         f"got {value!r}")
    return value


def read_not_convert(raw: dict) -> list[str]:
    # AWQ/HF write modules_to_not_convert, vLLM-style fp8 configs ignored_layers; null means none
    value = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config.modules_to_not_convert must be a list of module "
                         f"names; got {value!r}")
    return list(value)
