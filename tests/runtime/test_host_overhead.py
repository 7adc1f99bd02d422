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
