"""The real default model, SmolLM2-135M-Instruct (GGUF): same greedy tokens as HF, right answer."""

from __future__ import annotations

import os

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.config import default_model


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8)


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.outputs[0].text


def test_greedy_tokens_match_hf_on_the_gguf(llm):
    from transformers import AutoModelForCausalLM
    path = default_model()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    tok = llm.get_tokenizer()
    prompts = ["The quick brown fox", "def fibonacci(n):", "Kubernetes is"]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([tok(prompt).input_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=16, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref[:len(out.outputs[0].token_ids)]
        assert len(out.outputs[0].token_ids) == 16 or out.outputs[0].finish_reason == "stop"
