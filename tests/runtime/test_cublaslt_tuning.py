"""The engine with KVFLEET_CUBLASLT_TUNE=1 (kvfleet_kernels.cublaslt) on a GPU: it tunes its
projections and lm_head before capturing its graphs, its decode steps (at rows it was told to
tune) run the tuned GEMMs, and greedy output stays what it is without tuning."""

from __future__ import annotations

import random

import pytest
from kvfleet_kernels import cublaslt
from kvfleet_runtime import LLM, SamplingParams


@pytest.mark.gpu
def test_gpu_engine_with_tuning_serves_the_tuned_gemms(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    # 256 prompts decode in the 256-row graph, whose projections and lm_head were tuned
    # (KVFLEET_CUBLASLT_ROWS; every shape takes an algorithm: MIN_GAIN below any gain); greedy
    # tokens as without tuning

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 40))] for _ in range(256)]
    params = SamplingParams(temperature=0, max_tokens=6)
    path = tiny_model_dir("llama3")
    plain = [o.outputs[0].token_ids for o in
             LLM(model=path, dtype="bfloat16", max_num_seqs=256).generate(prompts, params)]
    monkeypatch.setenv("KVFLEET_CUBLASLT_TUNE", "1")
    monkeypatch.setenv("KVFLEET_CUBLASLT_ROWS", "256")
    monkeypatch.setattr(cublaslt, "MIN_GAIN", -1.0)
    served = []
    real_lookup = cublaslt.lookup

    def counting_lookup(x, w):
        gemm = real_lookup(x, w)
        if gemm is not None:
            served.append(tuple(w.shape))
        return gemm
    monkeypatch.setattr(cublaslt, "lookup", counting_lookup)
    cublaslt.clear()
    try:
        llm = LLM(model=path, dtype="bfloat16", max_num_seqs=256)
        assert cublaslt._TABLE, "nothing was tuned"
        tuned = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        cublaslt.clear()
    assert served, "no projection ran a tuned GEMM"
    same = sum(a == b for a, b in zip(plain, tuned, strict=True))
    assert same >= 0.95 * len(prompts), f"{same} of {len(prompts)} greedy outputs as without tuning"
