"""/metrics keeps the contract (names, labels) and counts what the answers say; a real
Prometheus scrapes it and computes the HPA's tokens/second."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.prometheus import start_prometheus
from support.server import ServerProcess, running_server

NAME = "metrics-model"
GAUGES = ["kvfleet_num_requests_running", "kvfleet_num_requests_waiting",
          "kvfleet_kv_cache_usage_perc"]
COUNTERS = ["kvfleet_prefix_cache_queries_total", "kvfleet_prefix_cache_hits_total",
            "kvfleet_num_preemptions_total", "kvfleet_prompt_tokens_total",
            "kvfleet_generation_tokens_total", "kvfleet_request_success_total",
            "kvfleet_http_requests_total", "kvfleet_engine_steps_total",
            "kvfleet_engine_step_seconds_total", "kvfleet_engine_device_wait_seconds_total"]
HISTOGRAMS = ["kvfleet_time_to_first_token_seconds", "kvfleet_inter_token_latency_seconds",
              "kvfleet_e2e_request_latency_seconds", "kvfleet_request_queue_time_seconds",
              "kvfleet_request_prompt_tokens", "kvfleet_request_generation_tokens"]


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "512",
                        "--block-size", "16") as s:
        yield s


def _complete(server: ServerProcess, prompt: str | list[int], max_tokens: int) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_every_contract_metric_is_exposed_with_model_name(server: ServerProcess) -> None:
    _complete(server, "warm up", 2)
    samples = [s for f in text_string_to_metric_families(server.metrics()) for s in f.samples
               if s.name.startswith("kvfleet_")]
    names = {s.name for s in samples}
    wanted = GAUGES + COUNTERS + [h + suffix for h in HISTOGRAMS
                                  for suffix in ("_bucket", "_sum", "_count")]
    assert set(wanted) <= names, set(wanted) - names
    assert all(s.labels.get("model_name") == NAME for s in samples)
    reasons = {s.labels["finished_reason"] for s in samples
               if s.name == "kvfleet_request_success_total"}
    assert reasons == {"stop", "length", "abort"}


def test_the_engine_series_under_vllms_names_equal_ours(server: ServerProcess) -> None:
    # what reads a vLLM server's metrics (the Gateway API Inference Extension's endpoint
    # picker, KEDA rules, dashboards) reads ours: every VLLM_NAMES family, sample by sample
    from kvfleet_runtime.server.metrics import VLLM_NAMES
    _complete(server, "warm up", 3)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(server.metrics()) for s in f.samples
               if not s.name.endswith("_created")}
    for ours, aliases in VLLM_NAMES.items():
        mine = {(n, labels): v for (n, labels), v in samples.items()
                if n == ours or n.startswith(ours + "_")}
        if ours != "kvfleet_lora_requests_info":    # (a series only with --enable-lora)
            assert mine, ours
        for alias in aliases:
            theirs = {(alias + n[len(ours):], labels): v for (n, labels), v in mine.items()}
            assert {k: samples.get(k) for k in theirs} == theirs, alias
    assert samples[("vllm:num_requests_waiting", (("model_name", NAME),))] == 0
    assert samples[("vllm:generation_tokens_total", (("model_name", NAME),))] >= 3


def test_the_process_series_a_prometheus_client_exports_by_default(server: ServerProcess) -> None:
    samples = {s.name: s for f in text_string_to_metric_families(server.metrics())
               for s in f.samples}
    assert samples["process_cpu_seconds_total"].value > 0
    assert samples["process_resident_memory_bytes"].value > 10 * 2**20
    assert "python_gc_collections_total" in samples and "python_info" in samples
    # the engine runs in a thread of this server: no engine process to report
    assert not any(name.startswith("kvfleet_engine_process_") for name in samples)


def test_counters_and_histograms_follow_each_request(server: ServerProcess) -> None:
    names = ["kvfleet_prompt_tokens_total", "kvfleet_generation_tokens_total",
             "kvfleet_time_to_first_token_seconds_count",
             "kvfleet_inter_token_latency_seconds_count",
             "kvfleet_e2e_request_latency_seconds_count",
             "kvfleet_request_queue_time_seconds_count",
             "kvfleet_request_prompt_tokens_sum", "kvfleet_request_generation_tokens_sum"]
    before = {n: server.metric(n) for n in names}
    length_before = server.metric("kvfleet_request_success_total", finished_reason="length")
    usage = _complete(server, "Count the tokens of this prompt please", 9)
    delta = {n: server.metric(n) - before[n] for n in names}
    assert delta == {
        "kvfleet_prompt_tokens_total": usage["prompt_tokens"],
        "kvfleet_generation_tokens_total": 9,
        "kvfleet_time_to_first_token_seconds_count": 1,
        "kvfleet_inter_token_latency_seconds_count": 8,     # one per token after the first
        "kvfleet_e2e_request_latency_seconds_count": 1,
        "kvfleet_request_queue_time_seconds_count": 1,
        "kvfleet_request_prompt_tokens_sum": usage["prompt_tokens"],
        "kvfleet_request_generation_tokens_sum": 9,
    }
    assert server.metric("kvfleet_request_success_total", finished_reason="length") == \
        length_before + 1


def test_engine_step_counters_follow_the_steps(server: ServerProcess) -> None:
    names = ["kvfleet_engine_steps_total", "kvfleet_engine_step_seconds_total",
             "kvfleet_engine_device_wait_seconds_total"]
    before = {n: server.metric(n) for n in names}
    _complete(server, "Count the steps of this request", 7)
    steps, step_s, wait_s = (server.metric(n) - before[n] for n in names)
    # a prefill step, then one a token (async scheduling may launch one more)
    assert 7 <= steps <= 9
    # the wait on the device is part of the steps' time, and the steps are not all wait
    assert 0 < wait_s < step_s


def test_prefix_cache_counters_count_tokens(server: ServerProcess) -> None:
    prompt = list(range(1000, 1064))        # 64 tokens: 4 full blocks of 16
    queries = server.metric("kvfleet_prefix_cache_queries_total")
    _complete(server, prompt, 2)
    hits = server.metric("kvfleet_prefix_cache_hits_total")
    _complete(server, prompt, 2)
    # the second run finds the full blocks of the first (the last token is always recomputed)
    assert server.metric("kvfleet_prefix_cache_hits_total") - hits >= 48
    assert server.metric("kvfleet_prefix_cache_queries_total") - queries >= 2 * 48


def test_http_requests_count_every_answer_including_errors(server: ServerProcess) -> None:
    def count(route: str, status: str) -> float:
        return server.metric("kvfleet_http_requests_total", method="POST", route=route,
                             status=status)
    bad, good = count("/v1/completions", "400"), count("/v1/completions", "200")
    assert httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "n": 0}
                      ).status_code == 400
    _complete(server, "fine", 1)
    assert count("/v1/completions", "400") == bad + 1
    assert count("/v1/completions", "200") == good + 1
    missing = server.metric("kvfleet_http_requests_total", route="unmatched", status="404")
    httpx.post(server.base_url + "/v1/nowhere", json={})
    assert server.metric("kvfleet_http_requests_total", route="unmatched",
                         status="404") == missing + 1


def test_prometheus_computes_generated_tokens_per_second(server: ServerProcess,
                                                         tmp_path: Path) -> None:
    prometheus = start_prometheus(tmp_path / "prometheus", [f"127.0.0.1:{server.port}"],
                                  scrape_interval="1s")
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            _complete(server, "Keep generating tokens", 16)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        # [10s] holds ~10 samples at a 1 s scrape interval: enough for rate() on a short test
        result = prometheus.wait_for(
            f'rate(kvfleet_generation_tokens_total{{model_name="{NAME}"}}[10s])',
            lambda r: bool(r) and float(r[0]["value"][1]) > 0, timeout=60)
        assert result[0]["metric"]["job"] == "kvfleet"
        ttft = prometheus.wait_for(
            "histogram_quantile(0.5, rate(kvfleet_time_to_first_token_seconds_bucket[10s]))",
            lambda r: bool(r) and float(r[0]["value"][1]) > 0, timeout=30)
        assert float(ttft[0]["value"][1]) < 10
        # vLLM's names, as the Inference Extension's endpoint picker queries them
        waiting = prometheus.wait_for(f'vllm:num_requests_waiting{{model_name="{NAME}"}}',
                                      lambda r: bool(r), timeout=30)
        assert float(waiting[0]["value"][1]) >= 0
    finally:
        stop.set()
        loader.join()
        prometheus.stop()
