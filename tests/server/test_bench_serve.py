"""`kvfleet bench serve` as a user runs it, against a real `kvfleet serve` of a tiny model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvfleet_runtime.benchmarks.plot import SERVE_KEYS
from kvfleet_runtime.cli import main
from support.server import ServerProcess, running_server


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    # as one benchmarks a server: no log line per request; the engine in its own process, as
    # on a GPU
    with running_server(tiny_llama, "--max-model-len", "512", "--disable-uvicorn-access-log",
                        "--engine-process") as s:
        yield s


def _bench(server: ServerProcess, tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "runs.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvfleet_runtime.cli", "bench", "serve",
         "--base-url", server.base_url, "--json", str(out), *flags],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT ms" in done.stdout and "req/s" in done.stdout
    assert "CPU (cores busy over the run): client " in done.stdout
    return json.loads(out.read_text())


def test_a_rate_sweep_reports_every_run_and_plots_it(server: ServerProcess,
                                                     tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    runs = _bench(server, tmp_path, "--num-prompts", "12", "--request-rate", "8,inf",
                  "--input-len", "24", "--output-len", "6", "--plot", str(png))
    assert [r["request_rate"] for r in runs] == [8.0, math.inf]
    for run in runs:
        assert set(SERVE_KEYS) <= set(run)
        assert run["completed"] == 12 and run["failed"] == 0
        assert run["total_output_tokens"] == 12 * 6
        assert run["total_input_tokens"] == 12 * 24
        assert 0 < run["ttft_ms_median"] <= run["ttft_ms_p99"]
        assert 0 < run["tpot_ms_mean"] and 0 < run["itl_ms_mean"]
        assert run["output_throughput"] == pytest.approx(72 / run["duration_s"])
        # the engine's steps during the run, read from the server's /metrics: 6 tokens each
        # for 12 requests take at least 6 steps, each with some host work and some wait
        assert run["engine_steps"] >= 6 and run["engine_step_ms_mean"] > 0
        assert 0 < run["engine_host_share"] < 1 and 0 < run["engine_busy"] <= 1
        # each request's headers came before its first token, and the server's own TTFT (from
        # taking the request in) is inside the client's
        assert 0 < run["accept_ms_median"] <= run["accept_ms_p99"] <= run["accept_ms_max"]
        assert run["accept_ms_mean"] < run["ttft_ms_mean"]
        assert 0 < run["server_queue_ms_mean"] <= run["server_ttft_ms_mean"] < run["ttft_ms_mean"]
        # the CPU each process used over the run, in cores
        for key in ("client_cpu", "server_cpu", "engine_process_cpu"):
            assert 0 < run[key] < 64, key
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shared_prefix_reports_the_prefix_cache_hit_rate(server: ServerProcess,
                                                        tmp_path: Path) -> None:
    # one at a time, so each question finds the system prompt cached by the one before
    (run,) = _bench(server, tmp_path, "--dataset", "shared-prefix", "--num-prompts", "6",
                    "--max-concurrency", "1", "--prefix-len", "64", "--input-len", "8",
                    "--output-len", "3", "--seed", "7")
    # 5 of 6 requests hit 64 of their 72 prompt tokens
    assert run["prefix_cache_hit_rate"] == pytest.approx(5 * 64 / (6 * 72), abs=0.05)
    assert run["max_concurrency"] == 1


def test_sharegpt_like_lengths_vary(server: ServerProcess, tmp_path: Path) -> None:
    (run,) = _bench(server, tmp_path, "--dataset", "sharegpt-like", "--num-prompts", "8",
                    "--input-len", "32", "--output-len", "6")
    assert run["completed"] == 8
    assert run["total_output_tokens"] != 8 * 6 and run["total_input_tokens"] != 8 * 32


def test_the_client_runs_without_importing_torch(server: ServerProcess) -> None:
    # a load generator for a remote server needs no torch (nor the time it takes to import)
    code = ("import sys\nfrom kvfleet_runtime.cli import main\n"
            f"code = main(['bench', 'serve', '--base-url', {server.base_url!r}, '--num-prompts', "
            "'2', '--input-len', '8', '--output-len', '2'])\n"
            "print('exit', code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "exit 0 False", out.stdout + out.stderr


def test_warm_connections_are_opened_before_the_clock_starts(server: ServerProcess,
                                                             tmp_path: Path) -> None:
    def health_gets() -> float:
        return server.metric("kvfleet_http_requests_total", method="GET", route="/health")

    before = health_gets()
    (run,) = _bench(server, tmp_path, "--num-prompts", "6", "--max-concurrency", "4",
                    "--input-len", "8", "--output-len", "3", "--warm-connections")
    # one GET a connection the run may use at once (4 in flight), then the run on them
    assert health_gets() - before == 4
    assert run["warm_connections"] is True and run["completed"] == 6


def test_bad_flags_and_unreachable_servers_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--request-rate", "fast"]) == 2
    assert "--request-rate must be numbers or inf" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "cannot list models at http://127.0.0.1:9" in capsys.readouterr().err


def test_a_server_without_metrics_is_reported_without_a_hit_rate(
        capsys: pytest.CaptureFixture[str]) -> None:
    # a run's figures are not lost to /metrics (behind a proxy, or the server going away)
    from kvfleet_runtime.benchmarks.serve import _server_totals
    assert _server_totals("http://127.0.0.1:9") is None
    assert ("no prefix-cache hit rate or engine figures: cannot read http://127.0.0.1:9/metrics"
            in capsys.readouterr().err)


def test_the_server_kept_no_access_log(server: ServerProcess, tmp_path: Path) -> None:
    _bench(server, tmp_path, "--num-prompts", "4", "--input-len", "8", "--output-len", "2")
    log = server.log(tail=1_000_000)
    assert "Uvicorn running on" in log       # uvicorn's own lines still come
    assert "POST /v1/completions" not in log and "GET /v1/models" not in log


def test_the_engine_process_is_reported_like_every_kvfleet_metric(server: ServerProcess) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    every = [s for f in text_string_to_metric_families(server.metrics()) for s in f.samples]
    samples = [s for s in every if s.name.startswith("kvfleet_engine_process_")]
    by_name = {s.name: s for s in every}
    assert by_name["kvfleet_engine_process_cpu_seconds_total"].value > 0
    assert by_name["kvfleet_engine_process_resident_memory_bytes"].value > 10 * 2**20
    # its own process, not the server's: the server started it once running
    assert (by_name["kvfleet_engine_process_start_time_seconds"].value
            >= by_name["process_start_time_seconds"].value)
    assert (by_name["kvfleet_engine_process_cpu_seconds_total"].value
            != by_name["process_cpu_seconds_total"].value)
    assert all(s.labels.get("model_name") for s in samples)
