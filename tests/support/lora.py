"""LoRA adapters for tests, written by PEFT itself (the format's own packer), and the reference:
HF transformers with the adapter applied by PEFT (unmerged, as served)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from support.hf_reference import greedy_of

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(model_dir: str | os.PathLike, out: str | os.PathLike, rank: int = 8,
                      alpha: float = 16.0, targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0,
                      scale: float = 0.5, use_rslora: bool = False) -> Path:
    """A random PEFT LoRA adapter of `model_dir` saved to `out` (adapter_config.json +
    adapter_model.safetensors). Both A and B are random (PEFT's default init leaves B at zero,
    an adapter that changes nothing), scaled so the adapter moves the logits visibly."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if base.config.model_type == "phi3":    # its projections are fused: q/k/v, gate/up
        from kvfleet_runtime.lora.adapter import FUSED_NAMES
        targets = tuple(dict.fromkeys(FUSED_NAMES.get(t, t) for t in targets))
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                        init_lora_weights=False, use_rslora=use_rslora)
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_lora_greedy(model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None,
                   prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate() one prompt at a time with the adapter applied by PEFT (None:
    the base model), cut after the first EOS."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    return greedy_of(model, prompts, max_new_tokens)
