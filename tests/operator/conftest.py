"""Fixtures for the operator tests: the Kubernetes emulator, and the operator running on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kopf.testing import KopfRunner
from operator_harness import load_crd, operator_runner
from support.kube import KubeCluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KubeCluster]:
    with KubeCluster(tmp_path, crds=[load_crd()]) as kube:
        yield kube


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
