"""The chart's PrometheusRule: valid for promtool, alerts fire on synthetic series, thresholds from values."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from observability.chart import (
    RUNBOOK,
    alerts,
    helm_template,
    promtool_binary,
    render,
    rendered_rule_groups,
    write_rules_file,
)

ALERTS_TEST = Path(__file__).with_name("alerts_test.yaml")


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool_binary(), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_disabled_by_default(tmp_path):
    kinds = {m["kind"] for m in render({}, tmp_path)}
    assert "PrometheusRule" not in kinds


def test_rules_pass_promtool_check(tmp_path):
    groups = rendered_rule_groups(tmp_path)
    rules = write_rules_file(groups, tmp_path / "rules.yaml")
    done = promtool("check", "rules", str(rules), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts(groups))} rules found" in done.stdout


def test_alerts_fire_on_synthetic_series(tmp_path):
    write_rules_file(rendered_rule_groups(tmp_path), tmp_path / "rules.yaml")
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    done = promtool("test", "rules", ALERTS_TEST.name, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_unit_test(tmp_path):
    tested = {case["alertname"] for group in yaml.safe_load(ALERTS_TEST.read_text())["tests"]
              for case in group["alert_rule_test"] if case["exp_alerts"]}
    assert tested == {rule["alert"] for rule in alerts(rendered_rule_groups(tmp_path))}


def test_every_alert_has_a_summary_and_a_runbook_section(tmp_path):
    # GitHub's heading anchor of "## KvfleetEngineDown" is "kvfleetenginedown"
    sections = {h.strip().lower() for h in re.findall(r"^## (\S+)\s*$", RUNBOOK.read_text(), re.M)}
    for rule in alerts(rendered_rule_groups(tmp_path)):
        name = rule["alert"]
        assert rule["annotations"]["summary"].strip(), name
        assert rule["annotations"]["runbook_url"] == f"docs/RUNBOOK.md#{name.lower()}"
        assert name.lower() in sections, f"docs/RUNBOOK.md has no '## {name}' section"
        assert rule["labels"]["severity"] in ("critical", "warning"), name


def test_thresholds_come_from_values(tmp_path):
    groups = rendered_rule_groups(tmp_path, {"errorRatio": 0.2, "kvCacheUsageFor": "10m",
                                             "queueTimeP95Seconds": 2.5})
    by_name = {rule["alert"]: rule for rule in alerts(groups)}
    assert by_name["KvfleetHighErrorRate"]["expr"].rstrip().endswith("> 0.2")
    assert by_name["KvfleetKVCacheFull"]["for"] == "10m"
    assert by_name["KvfleetQueueTimeHigh"]["expr"].rstrip().endswith("> 2.5")
    assert "above 2.5s" in by_name["KvfleetQueueTimeHigh"]["annotations"]["summary"]
    # keys left out keep their defaults
    assert by_name["KvfleetHPAAtMaxReplicas"]["for"] == "15m"
    rules = write_rules_file(groups, tmp_path / "rules.yaml")
    assert promtool("check", "rules", str(rules), cwd=tmp_path).returncode == 0


def test_unknown_threshold_is_named_with_the_allowed_keys(tmp_path):
    done = helm_template({"prometheusRule": {"enabled": True,
                                             "thresholds": {"errRatio": 0.1}}}, tmp_path)
    assert done.returncode != 0
    assert "prometheusRule.thresholds.errRatio is not a threshold" in done.stderr
    assert "errorRatio" in done.stderr and "kvCacheUsageRatio" in done.stderr


def test_manifest_is_a_prometheus_operator_rule(tmp_path):
    values = {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}
    rule = next(m for m in render(values, tmp_path) if m["kind"] == "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "llm"
    # prometheus-operator's ruleSelector usually matches the release label
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == "kvfleet"   # the release
