"""Fixtures for runtime tests: tiny checkpoints on disk (made once per session) and HF references."""

from __future__ import annotations

import pytest
import torch

from support.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Callable arch -> folder of a saved tiny random checkpoint (cached per session)."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}")))
        return made[arch]
    return get


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers' generate() one prompt at a time, cut after the first EOS."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            toks = gen[0, len(p):].tolist()
            for i, t in enumerate(toks):
                if t in eos:
                    toks = toks[:i + 1]
                    break
            out.append(toks)
    return out
