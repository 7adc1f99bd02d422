"""The Grafana dashboard: valid for its schemaVersion, shipped as a sidecar ConfigMap, covering the contract metrics."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from observability.chart import load_dashboard, only, promtool_binary, render
from observability.expressions import dashboard_queries
from observability.grafana_schema import dashboard_problems

CONTRACT_METRICS = [
    "kvfleet_num_requests_running", "kvfleet_num_requests_waiting", "kvfleet_kv_cache_usage_perc",
    "kvfleet_prefix_cache_queries_total", "kvfleet_prefix_cache_hits_total",
    "kvfleet_num_preemptions_total", "kvfleet_prompt_tokens_total",
    "kvfleet_generation_tokens_total", "kvfleet_request_success_total",
    "kvfleet_http_requests_total", "kvfleet_time_to_first_token_seconds_bucket",
    "kvfleet_inter_token_latency_seconds_bucket", "kvfleet_request_queue_time_seconds_bucket",
    "kvfleet_engine_step_seconds_total", "kvfleet_engine_device_wait_seconds_total",
    "process_cpu_seconds_total", "kvfleet_engine_process_cpu_seconds_total",
    "kube_horizontalpodautoscaler_status_desired_replicas", "kube_deployment_status_replicas",
]


def test_dashboard_is_valid_for_its_schema_version():
    assert dashboard_problems(load_dashboard()) == []


@pytest.mark.parametrize("breakage, expected", [
    (lambda d: d["panels"][1]["gridPos"].pop("w"), "gridPos needs integer h, w, x, y"),
    (lambda d: d["panels"][1]["gridPos"].update(x=20, w=8), "leaves the 24-column grid"),
    (lambda d: d["panels"][2]["gridPos"].update(x=0), "overlap on the grid"),
    (lambda d: d["panels"][2].update(id=d["panels"][1]["id"]), "is used more than once"),
    (lambda d: d["panels"][1]["targets"][0].update(expr="rate(x{pod=~\"$podd\"}[5m])"),
     "uses $podd, which no template variable defines"),
    (lambda d: d["panels"][1]["targets"][0].pop("refId"), "refId must be a non-empty string"),
    (lambda d: d["panels"][1].pop("datasource"), "datasource must be an object"),
    (lambda d: d.update(schemaVersion=27), "schemaVersion must be 39"),
    (lambda d: d["templating"]["list"][1].update(type="dropdown"), "type must be one of"),
])
def test_structural_check_catches_breakage(breakage, expected):
    dash = copy.deepcopy(load_dashboard())
    breakage(dash)
    assert any(expected in p for p in dashboard_problems(dash)), dashboard_problems(dash)


def test_dashboard_covers_the_contract_metrics():
    exprs = " ".join(q.expr for q in dashboard_queries(load_dashboard()))
    missing = [m for m in CONTRACT_METRICS if not re.search(rf"\b{m}\b", exprs)]
    assert missing == []


def test_every_dashboard_expression_parses(tmp_path):
    # promtool parses recording rules offline: one rule per panel target, variables filled in
    rules = [{"record": f"dashboard:panel{q.panel_id}:{q.ref_id}", "expr": q.expr}
             for q in dashboard_queries(load_dashboard())]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool_binary(), "check", "rules", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_disabled_by_default(tmp_path):
    assert not [m for m in render({}, tmp_path)
                if m["kind"] == "ConfigMap" and "kvfleet.json" in m.get("data", {})]


@pytest.mark.parametrize("labels", [None, {"grafana_dashboard": "1", "team": "llm"}])
def test_configmap_is_labelled_for_the_sidecar(tmp_path, labels):
    values: dict = {"grafanaDashboard": {"enabled": True}}
    if labels is not None:
        values["grafanaDashboard"]["labels"] = labels
    configmap = only([m for m in render(values, tmp_path) if m["kind"] == "ConfigMap"
                      and "kvfleet.json" in m.get("data", {})], "ConfigMap")
    for key, value in (labels or {"grafana_dashboard": "1"}).items():
        assert configmap["metadata"]["labels"][key] == value
    assert json.loads(configmap["data"]["kvfleet.json"]) == load_dashboard()
    kubernetes_validate.validate(configmap, "1.31", strict=True)
