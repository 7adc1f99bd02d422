"""The garbage-collector thresholds kvfleet's own processes (server, benchmarks) set after
start-up, KVFLEET_GC_THRESHOLD, and that the benchmarks do set them."""

from __future__ import annotations

import gc
import json

import pytest
from kvfleet_runtime.cli import main
from kvfleet_runtime.engine.gc_tuning import DEFAULT_THRESHOLD, gc_threshold, tune_gc


@pytest.fixture(autouse=True)
def _restore_gc_threshold():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)      # CPython's defaults, whatever ran before
    yield
    gc.set_threshold(*saved)


def test_threshold_values():
    assert gc_threshold("") == DEFAULT_THRESHOLD
    assert gc_threshold("python") is None
    assert gc_threshold("5000, 20,20") == (5000, 20, 20)
    for bad in ("1,2", "a,b,c", "0,10,10", "-1,10,10", "1000"):
        with pytest.raises(ValueError, match="KVFLEET_GC_THRESHOLD must be"):
            gc_threshold(bad)


def test_tune_gc_sets_the_thresholds_unless_told_python(monkeypatch):
    monkeypatch.delenv("KVFLEET_GC_THRESHOLD", raising=False)
    assert tune_gc() == DEFAULT_THRESHOLD == gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    monkeypatch.setenv("KVFLEET_GC_THRESHOLD", "python")
    assert tune_gc() == (700, 10, 10) == gc.get_threshold()
    monkeypatch.setenv("KVFLEET_GC_THRESHOLD", "3000,5,5")
    assert tune_gc() == (3000, 5, 5)


def test_bench_latency_runs_with_the_tuned_collector(tiny_model_dir, tmp_path, monkeypatch):
    # the benchmarks measure what `kvfleet serve` runs: the thresholds are set once loaded
    monkeypatch.delenv("KVFLEET_GC_THRESHOLD", raising=False)
    seen = []
    from kvfleet_runtime.engine.engine import LLMEngine
    real_step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: seen.append(gc.get_threshold())
                        or real_step(self))
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", tiny_model_dir("llama"), "--batch-size", "2",
                 "--input-len", "8", "--output-len", "3", "--num-iters", "1",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["tpot_ms"] > 0
    assert seen and set(seen) == {DEFAULT_THRESHOLD}
