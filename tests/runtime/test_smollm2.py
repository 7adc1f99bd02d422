"""The real default model, SmolLM2-135M-Instruct (GGUF): same greedy tokens as HF, right answer.

The default dtype on a CPU with native bf16 is bfloat16 (a quantized GGUF); the token-for-token
comparison with HF runs both in float32.
"""

from __future__ import annotations

import os

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.config import default_model


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8, dtype="float32")


def test_capital_of_france_in_the_default_dtype():
    from kvfleet_runtime.config import cpu_has_native_bf16
    llm = LLM(max_num_seqs=8)          # what scripts/run and `kvfleet generate` use
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert llm.engine.runner.dtype == expected
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


def test_auto_dtype_on_a_cpu(monkeypatch):
    """bf16 for half/quantized checkpoints where the CPU has bf16 instructions; fp32 otherwise."""
    from kvfleet_runtime import config as config_module
    from kvfleet_runtime.config import EngineConfig
    cfg = EngineConfig(model="unused", device="cpu")
    for native, half in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda native=native: native)
        assert cfg.resolve_dtype(torch.bfloat16) == half        # GGUF Q4_1 says bfloat16
        assert cfg.resolve_dtype(torch.float16) == half
        assert cfg.resolve_dtype(torch.float32) == torch.float32   # tiny test models
        assert cfg.resolve_dtype(None) == torch.float32
    assert EngineConfig(model="unused", device="cpu", dtype="float32").resolve_dtype(
        torch.bfloat16) == torch.float32
