"""Greedy output is token-identical to HF transformers, however the engine batches the work."""

from __future__ import annotations

import random

import pytest
from kvfleet_runtime import LLM, SamplingParams
from support.hf_reference import hf_greedy
from support.tiny_models import ARCHS

MAX_NEW = 12


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 49152) for _ in range(40)]     # a shared "system prompt"
    out = []
    for i in range(n):
        own = [rng.randrange(3, 49152) for _ in range(rng.randrange(2, 50))]
        out.append(system + own if i % 2 else own)
    return out


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _assert_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv
    assert not kv.req_to_blocks
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """Each case also with async scheduling: step N+1 is scheduled and launched before
    step N's tokens are read back (the CUDA default; on a CPU the same bookkeeping runs)."""
    return request.param


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    prompts = _prompts(32, seed=hash(request.param) % 1000)
    return path, prompts, hf_greedy(path, prompts, MAX_NEW)


def test_single_request_matches_hf(arch_case, async_scheduling):
    path, prompts, ref = arch_case
    llm = LLM(model=path, async_scheduling=async_scheduling, max_num_seqs=1)
    assert _generate(llm, prompts[:3]) == ref[:3]
    _assert_blocks_free(llm)


def test_32_mixed_requests_batched_match_hf(arch_case, async_scheduling):
    path, prompts, ref = arch_case
    llm = LLM(model=path, async_scheduling=async_scheduling, max_num_seqs=32)
    assert _generate(llm, prompts) == ref
    _assert_blocks_free(llm)


def test_small_chunked_prefill_matches_hf(arch_case, async_scheduling):
    path, prompts, ref = arch_case
    llm = LLM(model=path, async_scheduling=async_scheduling, max_num_seqs=8, max_num_batched_tokens=7)
    assert _generate(llm, prompts) == ref
    _assert_blocks_free(llm)


def test_preemption_on_tiny_block_pool_matches_hf(arch_case, async_scheduling):
    path, prompts, ref = arch_case
    llm = LLM(model=path, async_scheduling=async_scheduling, max_num_seqs=32, num_gpu_blocks=14, enable_prefix_caching=False)
    assert _generate(llm, prompts) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_blocks_free(llm)


def test_prefix_cache_hits_on_second_pass_and_stays_identical(arch_case, async_scheduling):
    path, prompts, ref = arch_case
    llm = LLM(model=path, async_scheduling=async_scheduling, max_num_seqs=32)
    assert _generate(llm, prompts) == ref
    hits_before = llm.engine.kv.prefix_cache_hits
    assert _generate(llm, prompts) == ref
    # every prompt of >= 2 blocks re-hits its full blocks
    assert llm.engine.kv.prefix_cache_hits - hits_before >= sum(
        (len(p) - 1) // 16 * 16 for p in prompts)
    _assert_blocks_free(llm)


def test_triton_path_in_the_interpreter_matches_hf(arch_case, monkeypatch):
    # The GPU code path (fused rotary + cache write, paged attention, norm and activation
    # kernels) on a CPU through Triton's interpreter: prefill chunks, mixed and decode steps
    # (four prompts, two with the shared prefix: the interpreter runs each program in Python)
    path, prompts, ref = arch_case
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model=path, attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=24)
    try:
        assert _generate(llm, prompts[:4]) == ref[:4]
        _assert_blocks_free(llm)
    finally:
        llm.engine.shutdown()
        llm.engine.config.attention_backend = "auto"
        from kvfleet_runtime.layers.backend import set_backend
        set_backend("auto")


@pytest.mark.parametrize("arch", ["qwen2", "llama3"])     # the bias itself: test_triton_gemv_hook.py
def test_triton_gemv_for_batch_one_in_the_interpreter_matches_hf(arch, tiny_model_dir,
                                                                 monkeypatch):
    # KVFLEET_TRITON_GEMV's path: every batch-1 decode projection through kvfleet_kernels.gemv
    from kvfleet_runtime.layers import linear
    path = tiny_model_dir(arch)
    prompts = _prompts(2, seed=3)[1:]           # one request (with the shared prefix)
    ref = hf_greedy(path, prompts, MAX_NEW)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_TRITON_GEMV", True)
    calls = []
    from kvfleet_kernels import gemv as gemv_module
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(model=path, attention_backend="triton", max_num_seqs=1)
    try:
        assert _generate(llm, prompts) == ref
        assert calls                                    # the decode steps took the GEMVs
    finally:
        llm.engine.shutdown()
        from kvfleet_runtime.layers.backend import set_backend
        set_backend("auto")
