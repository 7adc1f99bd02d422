"""Architecture switches read from config.json: a sliding window caps the context at its length
(where it equals full attention: HF's outputs within it), and what our model code does not do
(partial rotary, longrope) is refused when the model loads."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from support.tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM


@pytest.mark.parametrize("arch, window", [("mistral", 64), ("phi3", 47)])
def test_a_sliding_window_caps_the_context_and_matches_hf_within_it(arch, window, tmp_path):
    path = make_tiny_model(arch, tmp_path / arch, sliding_window=window)
    llm = LLM(model=str(path), num_gpu_blocks=32)
    assert llm.engine.config.max_model_len == window
    prompt = [(7 * i) % 4000 + 3 for i in range(window - 12)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False)[0, len(prompt):].tolist()
    assert out == ref
    with pytest.raises(ValueError, match=rf"max_model_len \({window + 1}\) is larger than the "
                                         rf"model's sliding window \({window} tokens"):
        LLM(model=str(path), num_gpu_blocks=32, max_model_len=window + 1)


def test_a_window_as_long_as_the_positions_caps_nothing(tmp_path):
    path = make_tiny_model("mistral", tmp_path / "m", sliding_window=1024)
    assert LLM(model=str(path), num_gpu_blocks=16).engine.config.max_model_len == 1024


def test_partial_rotary_is_refused(tmp_path):
    path = make_tiny_model("phi3", tmp_path / "p", partial_rotary_factor=0.75)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75 is not supported"):
        LLM(model=str(path), num_gpu_blocks=16)


def test_longrope_is_refused(tmp_path):
    path = make_tiny_model("phi3", tmp_path / "p", rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 256})
    with pytest.raises(ValueError, match="rope_scaling type must be one of default, linear, "
                                         "llama3; got 'longrope'"):
        LLM(model=str(path), num_gpu_blocks=16)
