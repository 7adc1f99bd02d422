"""The scheduler simulation (benchmarks/schedule_sim.py) counts what the real scheduler does."""

from __future__ import annotations

from kvfleet_runtime.benchmarks.schedule_sim import simulate


def test_simulation_counts_preemptions_and_their_recompute(tiny_model_dir):
    path = tiny_model_dir("llama3")
    # 12 prompts of 40 + 24 tokens on 20 usable blocks of 16: the same case as
    # test_admission_headroom, where the default admission preempts
    default = simulate(path, 21, 12, 40, 24, headroom=0, kv_bytes_per_token=131072,
                       max_num_seqs=16)
    full = simulate(path, 21, 12, 40, 24, headroom=24, kv_bytes_per_token=131072,
                    max_num_seqs=16)
    assert default["preemptions"] > 0 and default["recomputed_prompt_tokens"] > 0
    assert full["preemptions"] == 0 and full["recomputed_prompt_tokens"] == 0
    assert full["modelled_gpu_s"] > 0 and full["steps"] >= 24
