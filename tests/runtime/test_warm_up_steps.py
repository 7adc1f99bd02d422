"""The synthetic steps a GPU engine runs at start (ModelRunner._warm_up_eager_steps): prefill
and mixed batches, one for each compiled variant of the decode kernels, that write nothing
into the KV cache; here through the Triton kernels under the interpreter (an engine runs them
on CUDA only; whether they leave nothing to compile: tests/runtime/test_gpu_warm_up.py)."""

from __future__ import annotations

import torch
from kvfleet_runtime import LLM


def test_the_warm_up_runs_prefill_and_mixed_steps_and_writes_nothing(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama3"), dtype="float32", max_num_seqs=8,
              max_model_len=1024, max_num_batched_tokens=64, attention_backend="triton")
    runner = llm.engine.runner
    shapes = runner._warm_up_shapes()
    assert shapes[0] == (0, 0, 32)          # a prefill alone first
    for rows, context, chunk in shapes[1:]:
        assert 1 <= rows < 8 and rows + chunk <= 64 and chunk <= context < 1024
    # the decode kernel's variants by split count: contexts split in 1, 2, 4, ... partitions
    assert len({context for _, context, _ in shapes[1:]}) >= 2
    with torch.inference_mode():
        ids, positions, meta = runner._synthetic_step(3, 100, 17)
    assert meta.seq_lens.tolist() == [100, 100, 100, 17]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 20] and meta.min_query_len == 1
    assert positions.tolist() == [99, 99, 99, *range(17)] and meta.max_seq_len == 100
    runner.kv_cache.normal_()          # any write into it would show
    before = runner.kv_cache.clone()
    runner._warm_up_eager_steps()
    assert torch.equal(runner.kv_cache, before)
    # and the engine serves as before
    out = llm.generate([[5, 6, 7]], None)[0].outputs[0]
    assert out.token_ids
