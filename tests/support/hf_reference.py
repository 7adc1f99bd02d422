"""The reference every greedy test compares with: HF transformers' own generate()."""

from __future__ import annotations

import torch


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers' generate() one prompt at a time, cut after the first EOS."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_of(model, prompts, max_new_tokens)


def greedy_of(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """A loaded HF model's (or PEFT model's) greedy generate(), one prompt at a time, cut after
    the first EOS."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            toks = gen[0, len(p):].tolist()
            for i, t in enumerate(toks):
                if t in eos:
                    toks = toks[:i + 1]
                    break
            out.append(toks)
    return out
