"""Every dashboard query and alert expression, run by a real Prometheus against a loaded `kvfleet serve`.

Prometheus scrapes two targets: a real `kvfleet serve` of a tiny random llama,
labelled namespace/pod as the kubernetes-pods scrape job of a cluster would,
and a loopback /metrics serving kube-state-metrics' HPA and Deployment series
(no cluster here, see kube_state_metrics.py). A background load keeps tokens,
waiting requests, preemptions (a KV pool of a few blocks), 4xx and 503 answers
flowing while the queries run, so rates and quantiles have data. The chart's
alerts are loaded into that Prometheus with every threshold at -1 and every
`for` at 0s: each must then fire, which proves its expression returns data.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from support.prometheus import PrometheusServer, start_prometheus
from support.server import ServerProcess, running_server
from support.tiny_models import make_tiny_model

from observability.chart import alerts, load_dashboard, rendered_rule_groups, write_rules_file
from observability.expressions import dashboard_queries, variable_queries
from observability.kube_state_metrics import Hpa, serve_kube_state_metrics

pytestmark = pytest.mark.slow

MODEL_NAME = "chat"
NAMESPACE = "llm"
RATE_INTERVAL = "20s"       # $__rate_interval: 20 scrapes at 1 s
# every alert fires as soon as its expression has data
FIRE_ON_ANY_DATA = {
    "queueTimeP95Seconds": -1, "kvCacheUsageRatio": -1, "preemptionsPerMinute": -1,
    "errorRatio": -1, "engineDownFor": "0s", "targetMissingFor": "0s", "queueTimeFor": "0s",
    "kvCacheUsageFor": "0s", "preemptionsFor": "0s", "errorRateFor": "0s", "hpaMaxedFor": "0s",
}
SHARED_PREFIX = ("You are a careful assistant for a fleet of language model servers. Answer "
                 "briefly and precisely, and say so when you do not know. Question: ")


@dataclass
class Fleet:
    server: ServerProcess
    prometheus: PrometheusServer
    alert_names: set[str]
    statuses: Counter = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _loader: threading.Thread | None = None

    def start_load(self) -> None:
        self._loader = threading.Thread(target=drive_load, daemon=True,
                                        args=(self.server.base_url, self._stop, self.statuses))
        self._loader.start()

    def stop_load(self) -> None:
        self._stop.set()
        if self._loader is not None:
            self._loader.join(timeout=120)


def post(base_url: str, body: dict) -> int:
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def drive_load(base_url: str, stop: threading.Event, statuses: Counter) -> None:
    """Bursts of more requests than the server admits, plus two client errors per burst."""
    good = [{"model": MODEL_NAME, "prompt": f"{SHARED_PREFIX}question {i}?", "max_tokens": 64,
             "ignore_eos": True} for i in range(6)]
    bad = [{"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1},      # 400
           {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}]  # 404
    with ThreadPoolExecutor(len(good) + len(bad)) as pool:
        while not stop.is_set():
            statuses.update(pool.map(lambda body: post(base_url, body), good + bad))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("live")
    model = make_tiny_model("llama", workdir / "model")
    groups = rendered_rule_groups(workdir, FIRE_ON_ANY_DATA)
    rules = write_rules_file(groups, workdir / "rules.yaml")
    ksm = serve_kube_state_metrics([
        # at its max replicas: KvfleetHPAAtMaxReplicas
        Hpa(NAMESPACE, MODEL_NAME, current_replicas=2, desired_replicas=2, max_replicas=2),
        # a kvfleet HPA whose pods nobody scrapes: KvfleetEngineTargetMissing
        Hpa("gone", "orphan", current_replicas=1, desired_replicas=1, max_replicas=4),
    ])
    # max 2 running + 2 queued, and a KV pool of 8 blocks of 16 tokens: the 6-request
    # bursts of ~95 tokens each wait, get preempted and overflow the queue (503). The engine
    # in its own process, as on a GPU pod, for the kvfleet_engine_process_* series.
    with running_server(model, "--served-model-name", MODEL_NAME, "--max-num-seqs", "2",
                        "--max-queued-requests", "2", "--num-gpu-blocks", "8",
                        "--engine-process") as server:
        prometheus = start_prometheus(workdir / "prometheus", targets=[], rule_files=[rules],
                                      extra_config={"scrape_configs": [
            {"job_name": "kubernetes-pods", "static_configs": [{
                "targets": [f"127.0.0.1:{server.port}"],
                "labels": {"namespace": NAMESPACE, "pod": f"{MODEL_NAME}-0"}}]},
            {"job_name": "kube-state-metrics", "static_configs": [{"targets": [ksm.address]}]},
        ]})
        fleet = Fleet(server=server, prometheus=prometheus,
                      alert_names={rule["alert"] for rule in alerts(groups)})
        fleet.start_load()
        try:
            # rates need two scrapes inside the window after the first finished requests
            prometheus.wait_for("sum(increase(kvfleet_request_queue_time_seconds_count[20s]))",
                                lambda r: bool(r) and float(r[0]["value"][1]) > 0, timeout=120)
            yield fleet
        finally:
            fleet.stop_load()
            prometheus.stop()
            ksm.stop()


def has_a_number(result: list[dict]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


@pytest.mark.parametrize("query", dashboard_queries(load_dashboard(), RATE_INTERVAL),
                         ids=lambda q: f"panel{q.panel_id}-{q.ref_id}")
def test_dashboard_query_returns_data(fleet, query):
    # a few seconds of grace: the first scrapes after a burst may not hold every series yet
    fleet.prometheus.wait_for(query.expr, has_a_number, timeout=30)


def test_dashboard_variables_have_values(fleet):
    for var in variable_queries(load_dashboard()):
        series = fleet.prometheus.api("series", **{"match[]": var.selector})
        values = {s[var.label] for s in series if var.label in s}
        assert values, f"${var.name}: {var.selector} has no {var.label} label values"


def test_load_produced_errors_preemptions_and_prefix_hits(fleet):
    # the error, preemption and prefix-cache panels only mean something with such events in the data
    assert all(fleet.statuses[status] > 0 for status in (200, 400, 404, 503)), fleet.statuses
    for counter in ("kvfleet_num_preemptions_total", "kvfleet_prefix_cache_hits_total"):
        fleet.prometheus.wait_for(f"sum({counter})", lambda r: float(r[0]["value"][1]) > 0)


def test_every_alert_fires_on_live_data_but_engine_down(fleet):
    expected = fleet.alert_names - {"KvfleetEngineDown"}

    def firing(_result) -> bool:
        return expected <= firing_alerts(fleet.prometheus)
    fleet.prometheus.wait_for("vector(1)", firing, timeout=60)
    rules = [r for g in fleet.prometheus.api("rules")["groups"] for r in g["rules"]]
    assert [r["lastError"] for r in rules if r["health"] != "ok"] == []


def test_engine_down_fires_when_the_engine_stops(fleet):
    # last in this module: it stops the engine that the other tests query
    assert "KvfleetEngineDown" not in firing_alerts(fleet.prometheus)
    fleet.stop_load()
    fleet.server.stop()
    fleet.prometheus.wait_for(
        "vector(1)", lambda _: "KvfleetEngineDown" in firing_alerts(fleet.prometheus), timeout=30)


def firing_alerts(prometheus: PrometheusServer) -> set[str]:
    return {a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"]
            if a["state"] == "firing"}
