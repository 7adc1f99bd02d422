"""Render charts/kvfleet with the real helm and validate what comes out.

Core kinds are validated against the official Kubernetes schemas
(kubernetes-validate); LLMServices against the CRD's own openAPIV3Schema and the
operator's spec parser; prometheus-operator kinds have no offline schema and
are checked by the tests that render them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfleet"
CRD = REPO / "crds" / "llmservice.yaml"
KUBE_VERSION = "1.30.0"   # the oldest Kubernetes the chart supports (Chart.yaml kubeVersion, docs/DEPLOY.md)
CUSTOM_KINDS = {"LLMService", "ServiceMonitor", "PrometheusRule"}


def helm() -> str:
    local = REPO / ".tools" / "bin" / "helm"
    found = str(local) if local.exists() else shutil.which("helm")
    assert found, "helm not found: run scripts/install-tools (puts helm v3 in .tools/bin)"
    return found


def run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)


def template(values: dict[str, Any] | None, tmp_path: Path, *extra: str,
             release: str = "kvfleet", namespace: str = "kvfleet-system") -> list[dict[str, Any]]:
    """`helm template` with `values`; every rendered manifest, helm must succeed."""
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION, *extra]
    if values is not None:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    done = run_helm(*args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def validate(manifest: dict[str, Any]) -> None:
    """Raise if `manifest` is not a valid object of its kind."""
    kind = manifest["kind"]
    if kind == "LLMService":
        # CRD schemas are OpenAPI v3.0: boolean exclusiveMinimum, as in JSON Schema draft 4
        jsonschema.Draft4Validator(crd_schema()).validate(manifest)
        from kvfleet_operator.spec import parse_spec
        parse_spec({**manifest, "metadata": {"uid": "u", **manifest["metadata"]}})
        return
    if kind in CUSTOM_KINDS:
        assert manifest["apiVersion"] == "monitoring.coreos.com/v1", manifest["apiVersion"]
        assert manifest["metadata"]["name"] and isinstance(manifest["spec"], dict)
        return
    kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def one(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def render_notes(values: dict[str, Any], tmp_path: Path, namespace: str = "llm") -> str:
    """NOTES.txt as `helm install` prints it; install needs a cluster, so a copy of the
    chart renders it through a ConfigMap (every chart file is a named template)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ include "kvfleet/templates/NOTES.txt" . | quote }}\n')
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    done = run_helm("template", "kvfleet", str(chart), "--namespace", namespace, "-f", str(tmp_path / "values.yaml"),
                    "--show-only", "templates/zz-notes.yaml")
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)["data"]["notes"]
