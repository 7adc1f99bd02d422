"""The synthetic steps a GPU engine runs at start (ModelRunner._warm_up_eager_steps): prefill
and mixed batches that write nothing into the KV cache, here through the Triton kernels under
the interpreter (the warm-up itself runs on CUDA only; tests/runtime/test_gpu_warm_up.py)."""

from __future__ import annotations

import torch
from kvfleet_runtime import LLM


def test_synthetic_steps_run_every_shape_and_write_nothing(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama3"), dtype="float32", max_num_seqs=8,
              max_model_len=1024, attention_backend="triton")
    runner = llm.engine.runner
    runner.kv_cache.normal_()          # any write into it would show
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        for rows, context, chunk in [(0, 0, 32), (1, 512, 17), (7, 1023, 17)]:
            ids, positions, meta = runner._synthetic_step(rows, context, chunk)
            assert meta.seq_lens.tolist() == [context] * rows + [chunk]
            assert meta.query_start_loc.tolist() == list(range(rows + 1)) + [rows + chunk]
            assert meta.min_query_len == (1 if rows else chunk) and meta.max_query_len == chunk
            hidden = runner.model(ids, positions, meta)
            assert hidden.shape[0] == rows + chunk and torch.isfinite(hidden).all()
    assert torch.equal(runner.kv_cache, before)
