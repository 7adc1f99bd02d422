"""The GPU benchmark suite's rows on a CPU engine (tiny model): each asked-for row comes out,
named and with its figures, and an unknown row is refused."""

from __future__ import annotations

import json

import pytest
from kvfleet_runtime.benchmarks import suite
from support.tiny_models import make_tiny_model


@pytest.mark.slow
def test_rows_are_written_to_the_json(tmp_path, capsys):
    model = make_tiny_model("llama", tmp_path / "m", max_position_embeddings=4096)
    out = tmp_path / "rows.json"
    # 1000-token prompts: as many as the KV cache holds at 2000 tokens, capped by --max-num-seqs;
    # prefilled over 4 steps of 512 tokens, the first decoding during the later ones
    assert suite.main(["--model", str(model), "--rows", "bs1,profile-1000,tp128",
                       "--num-prompts", "3", "--max-num-seqs", "2", "--max-model-len", "2048",
                       "--max-num-batched-tokens", "512",
                       "--dtype", "float32", "--label", "cpu-", "--repeat", "2",
                       "--json", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert rows["cpu-bs1"]["decode_tokens_per_s_per_seq"] > 0
    assert rows["cpu-tp128"]["num_prompts"] == 3 and rows["cpu-tp128"]["max_num_seqs"] == 2
    assert rows["cpu-tp128"]["output_tokens_per_s"] > 0
    # --repeat 2: the throughput row again on the same engine, under its own name
    assert rows["cpu-tp128-run2"]["num_prompts"] == 3 and "cpu-bs1-run2" not in rows
    profiled = [name for name in rows if name.startswith("cpu-profile-bs2-")]
    assert sorted(profiled) == ["cpu-profile-bs2-decode", "cpu-profile-bs2-prefill"]
    # the 32 profiled decode steps ran with both requests (none finished inside them)
    assert rows["cpu-profile-bs2-decode"]["batch"] == [2, 2]
    assert "[profile batch 2 x 1000] decode: 32 step(s) at batch 2->2" in capsys.readouterr().out


@pytest.mark.slow
def test_tp1000_half_runs_half_the_prompts_at_most(tmp_path):
    # 3 prompts of 1000 in / 1000 out at most 2 running (of the engine's 4): two waves, 2 then 1
    model = make_tiny_model("llama", tmp_path / "m", max_position_embeddings=4096)
    out = tmp_path / "rows.json"
    assert suite.main(["--model", str(model), "--rows", "tp1000-half", "--num-prompts", "3",
                       "--max-num-seqs", "4", "--max-model-len", "2048", "--dtype", "float32",
                       "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["row"] == "tp1000-seqs2" and row["max_num_seqs"] == 2
    assert row["num_prompts"] == 3 and row["output_len"] == 1000
    # the third prompt waits for a free place: ~1000 steps of the first two, ~1000 of it alone
    assert row["steps"] >= 2000


def test_unknown_rows_are_refused(capsys):
    with pytest.raises(SystemExit):
        suite.main(["--model", "unused", "--rows", "bs1,tp9999"])
    assert "unknown tp9999" in capsys.readouterr().err


def test_repeat_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        suite.main(["--model", "unused", "--rows", "tp128", "--repeat", "0"])
    assert "--repeat must be >= 1" in capsys.readouterr().err


def test_trace_first_use_reports_steps_and_outside_time(tmp_path, capsys):
    model = make_tiny_model("llama", tmp_path / "m")
    out = tmp_path / "rows.json"
    assert suite.main(["--model", str(model), "--rows", "tp128", "--num-prompts", "3",
                       "--max-num-seqs", "2", "--max-model-len", "512", "--dtype", "float32",
                       "--trace-first-use", "--json", str(out)]) == 0
    row = json.loads(out.read_text())[0]
    # 3 prompts at 2 running: the timed run's steps only (not the warm-up's), each logged
    assert 0 <= row["outside_steps_s"] < row["elapsed_s"]
    assert row["engine_step_s"] <= row["elapsed_s"]
    assert len(row["first_steps_ms"]) == 4 and len(row["slowest_steps"]) == 6
    index, ms, tokens, seqs = row["slowest_steps"][0]
    assert ms == max(s[1] for s in row["slowest_steps"]) and 1 <= seqs <= 2 and tokens >= seqs
    # 128 tokens each, at most 2 at a time: ~192 decode steps of 1 or 2 sequences
    assert row["decode_step_median_ms"] > 0 and row["steps"] >= 128
    kinds = row["time_by_kind"]
    assert set(kinds) <= {"prefill or mixed", "decode 1-127", "empty"}
    # every logged step in one kind; the decode steps' tokens are their sequences
    assert sum(k[0] for k in kinds.values()) == row["steps"]
    # every prompt computed whole in the timed run (the warm-up's cached blocks were dropped)
    assert sum(k[2] for k in kinds.values()) == 3 * 128 + 3 * 127
    assert kinds["decode 1-127"][1] <= row["engine_step_s"] + 1e-3


def test_steps_are_told_apart_by_kind_and_batch():
    from kvfleet_runtime.benchmarks.first_use import time_by_kind
    steps = [(0.5, 16384, 130), (0.04, 900, 900), (0.05, 880, 880), (0.02, 128, 128),
             (0.007, 116, 116), (0.002, 1, 1), (0.001, 0, 0)]
    assert time_by_kind(steps) == {"prefill or mixed": [1, 0.5, 16384],
                                   "decode 512+": [2, 0.09, 1780],
                                   "decode 128-511": [1, 0.02, 128],
                                   "decode 1-127": [2, 0.009, 117], "empty": [1, 0.001, 0]}


def test_compile_log_records_each_compile_under_its_row(monkeypatch):
    from kvfleet_runtime.benchmarks.first_use import CompileLog
    from triton import knobs
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    log = CompileLog()
    assert log.install() and knobs.runtime.jit_post_compile_hook == log._after

    class Fn:
        module, name = "kvfleet_kernels.argmax", "_sample_rows_kernel"
    log.row = "tp128"
    # Triton calls the hooks with keywords; False lets the compile go on
    assert knobs.runtime.jit_cache_hook(key="k1", repr="r1", fn=Fn, compile={},
                                        is_manual_warmup=False, already_compiled=False) is False
    assert knobs.runtime.jit_post_compile_hook(key="k1", repr="r1", fn=Fn, compile={},
                                               is_manual_warmup=False,
                                               already_compiled=False) is False
    log.row = "tp1000"
    assert log.summary("tp128")["compiles"] == 1 and log.summary("tp1000")["compiles"] == 0
    row, took, name, text = log.events[0]
    assert (row, name, text) == ("tp128", "kvfleet_kernels.argmax._sample_rows_kernel", "r1")
    assert took >= 0
