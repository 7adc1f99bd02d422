"""LoRA adapters (PEFT format) served beside the base model, as vLLM's multi-LoRA serving.

A request names its adapter with a LoRARequest; the engine (enable_lora=True) loads the
adapter's A/B matrices once (a CPU cache of max_cpu_loras adapters), keeps up to max_loras of
them in device slots, and adds each token's own adapter's x @ A^T @ B^T * scaling to the
targeted projections (layers.py). See docs/SERVER.md, "LoRA adapters".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request (vLLM's fields): its name, a positive id unique to the adapter
    (the engine caches by it; the same id must always mean the same path) and the folder
    holding adapter_config.json and adapter_model.safetensors."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive integer; got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
