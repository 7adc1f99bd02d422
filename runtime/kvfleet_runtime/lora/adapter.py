"""Reading a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors).

Tensors are named `base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); the update of a module is x @ A^T @ B^T * scaling with scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). Each targeted projection maps onto our fused modules
(q/k/v -> qkv_proj pieces 0/1/2, gate/up -> gate_up_proj pieces 0/1) as the base checkpoint's
tensors do. What this engine cannot apply exactly (DoRA, trained biases, modules_to_save,
embedding or lm_head adapters, per-module ranks) is refused with the reason, never dropped.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

from kvfleet_runtime.lora import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may target: checkpoint name -> (our module, piece; FUSED: a
# model that stores the projection fused (Phi-3): one A for all pieces, B's rows split)
FUSED = "fused"
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", None), "gate_proj": ("gate_up_proj", 0),
           "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
           "qkv_proj": ("qkv_proj", FUSED), "gate_up_proj": ("gate_up_proj", FUSED)}
# the seven projections as most checkpoints name them, and the fused names a model that fuses
# them (Phi-3) uses instead
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_NAMES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
# our modules that carry adapter slots, and how many pieces each has
SLOT_MODULES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: (our module path, piece) -> (A [r, in], B [out, r]
    already multiplied by the scaling)."""
    request: LoRARequest
    rank: int
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def id(self) -> int:
        return self.request.lora_int_id


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {path!r}: {why}")


def read_config(path: str) -> dict:
    """adapter_config.json of a PEFT adapter folder, checked for what this engine can apply."""
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise _refuse(path, f"no {CONFIG_FILE} (expected a PEFT adapter folder)")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(path, f"unreadable {CONFIG_FILE}: {e}") from e
    if not isinstance(config, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _refuse(path, f"peft_type {peft_type!r} is not supported (LORA only)")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _refuse(path, f"r must be a positive integer; got {r!r}")
    unsupported = {
        "use_dora": "DoRA adapters", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "lora_bias": "trained LoRA biases (lora_bias)"}
    for key, what in unsupported.items():
        if config.get(key):
            raise _refuse(path, f"{what} are not supported")
    if config.get("bias", "none") != "none":
        raise _refuse(path, f"bias={config['bias']!r} is not supported (bias='none' only)")
    return config


def load_adapter(request: LoRARequest, module_paths: set[str], max_rank: int,
                 input_sizes: dict[str, int], output_sizes: dict[str, list[int]]) -> LoRAAdapter:
    """Read and check an adapter for a model whose slot-carrying modules are module_paths
    (e.g. "model.layers.0.self_attn.qkv_proj", with their input size and output pieces)."""
    from safetensors import safe_open

    path = request.lora_path
    config = read_config(path)
    rank = config["r"]
    if rank > max_rank:
        raise _refuse(path, f"rank {rank} is larger than max_lora_rank ({max_rank}); start the "
                            f"engine with max_lora_rank >= {rank} (--max-lora-rank)")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _refuse(path, f"lora_alpha must be a number; got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights_file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        found = "adapter_model.bin" if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise _refuse(path, f"no {WEIGHTS_FILE}" + (
            " (adapter_model.bin found: save it with safe_serialization=True)" if found else ""))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(weights_file, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            module, kind = _split_name(path, name)
            pairs.setdefault(module, {})[kind] = f.get_tensor(name)
    if not pairs:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA tensors")
    adapter = LoRAAdapter(request, rank)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"{module}: lora_A and lora_B must both be present")
        parent, _, proj = module.rpartition(".")
        if proj not in TARGETS:
            raise _refuse(path, f"{module}: LoRA on {proj!r} is not supported (supported: "
                                f"{', '.join(TARGETS)})")
        ours, piece = TARGETS[proj]
        target = f"{parent}.{ours}"
        if target not in module_paths:
            raise _refuse(path, f"{module}: the model has no such module")
        a, b = ab["A"], ab["B"]
        out_size = (sum(output_sizes[target]) if piece == FUSED
                    else output_sizes[target][piece or 0])
        if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, input_sizes[target]) \
                or b.shape != (out_size, rank):
            raise _refuse(path, f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                                f"do not fit rank {rank}, {input_sizes[target]} inputs and "
                                f"{out_size} outputs")
        if piece == FUSED:      # x @ A^T once a piece (the same A), each piece its B rows
            for p, b_piece in enumerate(b.float().split(output_sizes[target])):
                adapter.weights[(target, p)] = (a.float(), b_piece * scaling)
            continue
        adapter.weights[(target, piece or 0)] = (a.float(), b.float() * scaling)
    return adapter


def _split_name(path: str, name: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ->
    ("model.layers.0.self_attn.q_proj", "A")."""
    for kind in ("A", "B"):
        for suffix in (f".lora_{kind}.weight", f".lora_{kind}.default.weight"):
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                module = module.removeprefix("base_model.model.")
                return module, kind
    if "lora_embedding" in name:
        raise _refuse(path, f"{name}: LoRA on embeddings is not supported")
    raise _refuse(path, f"{name}: not a LoRA A/B tensor")
