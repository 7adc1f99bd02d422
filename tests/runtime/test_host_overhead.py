"""The host-time harness (benchmarks/host_overhead.py) on a small batch: both scheduling modes
report their figures and phases, and produce the same greedy outputs (its output hash)."""

from __future__ import annotations

import json

from kvfleet_runtime.benchmarks import host_overhead


def test_both_modes_report_and_agree_on_outputs(capsys):
    assert host_overhead.main(["--num-prompts", "6", "--input-len", "8", "--output-len", "5",
                               "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
                               "--repeats", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = [r for r in lines if "output_hash" in r]
    assert [r["mode"] for r in runs] == ["sync", "async"]
    assert runs[0]["output_hash"] == runs[1]["output_hash"]
    assert all(r["tokens"] == 6 * 5 and r["steps"] > 5 and r["host_ms_per_step"] > 0 for r in runs)
    breakdowns = [r["breakdown"] for r in lines if "breakdown" in r]
    assert len(breakdowns) == 2 and all(b["schedule"] > 0 for b in breakdowns)


def test_streamed_outputs_are_the_offline_ones_and_their_pickling_is_host_time(capsys):
    assert host_overhead.main(["--num-prompts", "6", "--input-len", "8", "--output-len", "5",
                               "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
                               "--repeats", "1", "--mode", "async", "--outputs", "both"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = [r for r in lines if "output_hash" in r]
    assert [r["mode"] for r in runs] == ["async", "async+stream"]
    # the deltas, merged back as the server merges them, are the offline path's outputs
    assert runs[0]["output_hash"] == runs[1]["output_hash"]
    assert all(r["tokens"] == 6 * 5 for r in runs)
    breakdowns = {r["mode"]: r["breakdown"] for r in lines if "breakdown" in r}
    assert breakdowns["async+stream"]["post"] > 0 and breakdowns["async+stream"]["outputs"] > 0
    assert breakdowns["async"].get("post", 0) == 0
