"""Architecture switches read from config.json: sliding-window attention as HF applies it (each
layer's window; HF's greedy outputs past the window on both attention paths), and what our model
code does not do is refused when the model loads; partial rotary and longrope (Phi-3.5-mini,
Phi-4-mini) as HF runs them."""

from __future__ import annotations

import random

import pytest
import torch
from kvfleet_runtime import LLM, SamplingParams
from kvfleet_runtime.models.config import layer_windows
from support.hf_reference import greedy_of, hf_greedy
from support.tiny_models import make_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

# (arch, config overrides, the layers' windows): every layer windowed (Mistral, Phi-3), Qwen2's
# layers from max_window_layers on, Qwen3's as layer_types names them
WINDOWED = [
    ("mistral", dict(sliding_window=9), (9, 9)),
    ("phi3", dict(sliding_window=13), (13, 13)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=11, max_window_layers=1), (0, 11)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=7,
                   layer_types=["sliding_attention", "full_attention"]), (7, 0)),
]


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 49152) for _ in range(35)]      # a prefix the cache shares
    return [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (2, 20, 37)] + [
        [rng.randrange(3, 49152) for _ in range(6)]]


@pytest.mark.parametrize("arch, overrides, windows", WINDOWED, ids=[c[0] for c in WINDOWED])
def test_sliding_window_attention_matches_hf_past_the_window(arch, overrides, windows, tmp_path,
                                                             monkeypatch):
    path = make_tiny_model(arch, tmp_path / arch, **overrides)
    prompts = _prompts()
    ref = hf_greedy(path, prompts, 12)
    # the window changes these outputs: the same weights with full attention give others
    config = AutoConfig.from_pretrained(path)
    config.sliding_window, config.layer_types = None, ["full_attention"] * config.num_hidden_layers
    hf_full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, config=config)
    assert greedy_of(hf_full, prompts, 12) != ref
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def generate(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    # the torch path: whole prompts, then 8-token chunks (windows across chunks), and again
    # with the prompts' shared blocks from the prefix cache
    llm = LLM(model=str(path), num_gpu_blocks=64)
    assert llm.engine.config.max_model_len == 1024      # the window caps no context
    assert llm.engine.runner.model_config.sliding_windows == windows
    # blocks leave a request's window early only when every layer has that window
    assert llm.engine.kv.sliding_window == (windows[0] if len(set(windows)) == 1 else 0)
    assert generate(llm) == ref
    chunked = LLM(model=str(path), num_gpu_blocks=64, max_num_batched_tokens=8, max_num_seqs=2)
    assert generate(chunked) == ref
    hits = chunked.engine.kv.prefix_cache_hits
    assert generate(chunked) == ref and chunked.engine.kv.prefix_cache_hits > hits
    if arch in ("qwen2", "phi3"):
        return          # the kernels' windows: every layer's (mistral), one layer's (qwen3)
    # the Triton kernels (in the interpreter): prefill, mixed and decode steps
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model=str(path), attention_backend="triton", num_gpu_blocks=64,
              max_num_batched_tokens=24, max_num_seqs=4)
    try:
        assert generate(llm) == ref
    finally:
        llm.engine.shutdown()
        from kvfleet_runtime.layers.backend import set_backend
        set_backend("auto")


@pytest.mark.parametrize("arch, hf, windows", [
    ("MistralForCausalLM", dict(sliding_window=4096, max_position_embeddings=32768), (4096,) * 3),
    ("MistralForCausalLM", dict(sliding_window=4096, max_position_embeddings=4096), ()),
    ("MistralForCausalLM", dict(sliding_window=None), ()),
    ("Phi3ForCausalLM", dict(sliding_window=2047, max_position_embeddings=4096), (2047,) * 3),
    ("LlamaForCausalLM", dict(sliding_window=16), ()),
    ("Qwen2ForCausalLM", dict(sliding_window=32768, use_sliding_window=False), ()),
    ("Qwen2ForCausalLM", dict(sliding_window=64, use_sliding_window=True), ()),    # 28 full
    ("Qwen2ForCausalLM", dict(sliding_window=64, use_sliding_window=True, max_window_layers=2),
     (0, 0, 64)),
    ("Qwen3ForCausalLM", dict(sliding_window=64, use_sliding_window=True,
                              layer_types=["full_attention", "sliding_attention"] * 2), (0, 64) * 2),
])
def test_each_layers_window_is_read_as_hf_applies_it(arch, hf, windows):
    config = {"num_hidden_layers": 4 if arch == "Qwen3ForCausalLM" else 3,
              "max_position_embeddings": 32768, **hf}
    assert layer_windows(config, arch) == windows


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _on_triton(path, monkeypatch, **kwargs) -> LLM:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return LLM(model=str(path), attention_backend="triton", num_gpu_blocks=64, **kwargs)


def _back_to_auto(llm: LLM) -> None:
    llm.engine.shutdown()
    from kvfleet_runtime.layers.backend import set_backend
    set_backend("auto")


def test_partial_rotary_matches_hf(tmp_path, monkeypatch):
    # Phi-4-mini rotates 0.75 of each head; here half of the tiny model's 16 dims (weights drawn
    # wide: attention sharp enough that positions move the greedy tokens)
    path = make_tiny_model("phi3", tmp_path / "p", partial_rotary_factor=0.5,
                           initializer_range=0.3)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 30, 61)]
    ref = hf_greedy(path, prompts, 12)
    config = AutoConfig.from_pretrained(path)
    config.rope_parameters["partial_rotary_factor"] = config.partial_rotary_factor = 1.0
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, config=config)
    assert greedy_of(whole, prompts, 12) != ref          # the partial rotation matters here
    llm = LLM(model=str(path), num_gpu_blocks=64)
    assert llm.engine.runner.model_config.rotary_dim == 8
    assert _greedy(llm, prompts) == ref
    llm = _on_triton(path, monkeypatch, max_num_batched_tokens=24)
    try:             # the rotary kernel's partial rotation: the longest prompt, in chunks
        assert _greedy(llm, prompts[-1:]) == ref[-1:]
    finally:
        _back_to_auto(llm)


def test_longrope_takes_its_factors_by_max_model_len_and_matches_hf(tmp_path, monkeypatch):
    # Phi-3.5-mini / Phi-4-mini's scaling (with Phi-4-mini's partial rotary): the short factors
    # for an engine whose contexts stay within original_max_position_embeddings (HF's for any
    # sequence that does), the long ones beyond (HF's for a prompt longer than it)
    rng = random.Random(1)
    short = [round(1 + rng.random(), 3) for _ in range(4)]
    long = [round(30 + 60 * rng.random(), 3) for _ in range(4)]
    path = make_tiny_model("phi3", tmp_path / "p", partial_rotary_factor=0.5,
                           rope_scaling={"rope_type": "longrope", "short_factor": short,
                                         "long_factor": long},
                           original_max_position_embeddings=64)
    within = [[rng.randrange(3, 49152) for _ in range(n)] for n in (10, 40, 25, 33)]
    beyond = [[rng.randrange(3, 49152) for _ in range(n)] for n in (70, 100)]
    ref_within, ref_beyond = hf_greedy(path, within, 12), hf_greedy(path, beyond, 12)
    short_llm = LLM(model=str(path), max_model_len=64, num_gpu_blocks=64)
    assert _greedy(short_llm, within) == ref_within
    long_llm = LLM(model=str(path), num_gpu_blocks=64)           # max_model_len 1024
    assert _greedy(long_llm, beyond) == ref_beyond
    # the set matters: under the long factors the short prompts are not HF's (vLLM's rule too)
    assert _greedy(long_llm, within) != ref_within
    llm = _on_triton(path, monkeypatch, max_num_batched_tokens=24)
    try:             # the kernels over the long factors' cos/sin: one prompt, in chunks
        assert _greedy(llm, beyond[-1:]) == ref_beyond[-1:]
    finally:
        _back_to_auto(llm)


@pytest.mark.parametrize("arch, scaling", [
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ("llama", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 48,
               "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5})])
def test_yarn_matches_hf_past_the_original_length(arch, scaling, tmp_path, monkeypatch):
    # Qwen3's model card adds {"rope_type": "yarn", "factor": 4, "original_...": 32768} for
    # 128k; DeepSeek's configs carry the mscale pair (weights drawn wide, positions matter)
    path = make_tiny_model(arch, tmp_path / arch, rope_scaling=scaling, initializer_range=0.3)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (20, 70, 130)]
    ref = hf_greedy(path, prompts, 12)
    config = AutoConfig.from_pretrained(path)
    config.rope_parameters = {"rope_type": "default",
                              "rope_theta": config.rope_parameters["rope_theta"]}
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, config=config)
    assert greedy_of(plain, prompts, 12) != ref             # the scaling matters here
    assert _greedy(LLM(model=str(path), num_gpu_blocks=64), prompts) == ref
    # the same weights saved without it, the scaling given as vLLM's --hf-overrides
    bare = make_tiny_model(arch, tmp_path / "bare", initializer_range=0.3)
    assert _greedy(LLM(model=str(bare), num_gpu_blocks=64,
                       hf_overrides={"rope_scaling": scaling}), prompts) == ref
    llm = _on_triton(path, monkeypatch, max_num_batched_tokens=24)
    try:             # the kernels over the scaled cos/sin: the longest prompt, in chunks
        assert _greedy(llm, prompts[-1:]) == ref[-1:]
    finally:
        _back_to_auto(llm)


def test_an_unknown_rope_scaling_is_refused(tmp_path):
    path = make_tiny_model("llama", tmp_path / "p", rope_scaling={
        "rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling type must be one of default, linear, "
                                         "llama3, longrope, yarn; got 'dynamic'"):
        LLM(model=str(path), num_gpu_blocks=16)


def test_phi3_minis_head_dim_of_96_runs_the_triton_kernels(tmp_path, monkeypatch):
    # Phi-3-mini / Phi-3.5-mini: 3072 / 32 heads = 96 dims a head, not a power of two (the
    # attention tiles span 128, the pad masked); with its 2047-token window's kind of mask
    path = make_tiny_model("phi3", tmp_path / "p", hidden_size=192, num_attention_heads=2,
                           num_key_value_heads=1, sliding_window=21)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 30, 45)]
    ref = hf_greedy(path, prompts, 12)
    llm = _on_triton(path, monkeypatch, max_num_batched_tokens=24, max_num_seqs=2)
    try:
        assert llm.engine.runner.model_config.head_dim == 96
        assert _greedy(llm, prompts) == ref
    finally:
        _back_to_auto(llm)
