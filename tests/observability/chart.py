"""Renders charts/kvfleet with the real helm and hands back the observability pieces."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "kvfleet"
DASHBOARD_JSON = CHART_DIR / "dashboards" / "kvfleet.json"
RUNBOOK = REPO / "docs" / "RUNBOOK.md"


def helm_binary() -> str:
    found = REPO / ".tools" / "bin" / "helm"
    if found.exists():
        return str(found)
    on_path = shutil.which("helm")
    assert on_path, "helm not found: run scripts/install-tools (puts it in .tools/bin)"
    return on_path


def promtool_binary() -> str:
    found = shutil.which("promtool")
    assert found, "promtool not found: run scripts/install-tools (Debian's prometheus package)"
    return found


def helm_template(values: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    return subprocess.run(
        [helm_binary(), "template", "kvfleet", str(CHART_DIR), "--namespace", "llm",
         "-f", str(values_file)],
        capture_output=True, text=True, timeout=120)


def render(values: dict, tmp_path: Path) -> list[dict]:
    """Every manifest the chart renders with `values` (helm must succeed)."""
    done = helm_template(values, tmp_path)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def only(manifests: list[dict], kind: str) -> dict:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def rendered_rule_groups(tmp_path: Path, thresholds: dict | None = None) -> list[dict]:
    values = {"prometheusRule": {"enabled": True, "thresholds": thresholds or {}}}
    return only(render(values, tmp_path), "PrometheusRule")["spec"]["groups"]


def write_rules_file(groups: list[dict], path: Path) -> Path:
    """The PrometheusRule's spec.groups as a plain Prometheus rules file."""
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def alerts(groups: list[dict]) -> list[dict]:
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD_JSON.read_text())
