"""Fixtures for the operator tests: the CRD, the Kubernetes emulator, and the operator running on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner
from support.kube import KubeCluster

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "llmservice.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KubeCluster]:
    with KubeCluster(tmp_path, crds=[load_crd()]) as kube:
        yield kube


def operator_runner() -> KopfRunner:
    """The real operator module under kopf, as `kvfleet-operator` runs it (minus liveness)."""
    return KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvfleet_operator.main"],
                      timeout=30)


@pytest.fixture
def operator_env(cluster: KubeCluster, monkeypatch: pytest.MonkeyPatch) -> KubeCluster:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # A reconcile blocked by a missing Secret is retried after this many seconds.
    monkeypatch.setenv("KVFLEET_OPERATOR_RETRY_DELAY", "1")
    return cluster


@pytest.fixture
def operator(operator_env: KubeCluster) -> Iterator[KopfRunner]:
    with operator_runner() as runner:
        yield runner
    assert runner.exit_code == 0, runner.output
