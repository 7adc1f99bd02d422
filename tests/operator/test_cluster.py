"""End-to-end against a real cluster: `pytest -m cluster tests/operator/test_cluster.py`.

Needs KUBECONFIG pointing at a cluster where you may create CRDs and
namespaces (kind, k3d, minikube, or a GPU cluster). Deselected by default; none
of it has run here (no cluster can run on the CI machine). The operator runs
in this process against that cluster (watching only the test namespace), as in
the emulator tests. Stop an operator installed in the cluster first if it
watches all namespaces, or the two would both reconcile the test objects.

Environment:
  KVFLEET_E2E_MODEL_URI   a model the runtime image can serve (e.g. pvc://models/SmolLM2);
                          enables the test that waits for Ready and calls /v1/models
  KVFLEET_E2E_IMAGE       runtime image (default: the CRD default)
  KVFLEET_E2E_GPUS        GPUs per replica for that test (default 0: CPU)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from operator_harness import BAD_SPECS, CRD_PATH, BadSpec, example_llmservices, operator_runner
from support.kube import wait_for

pytestmark = pytest.mark.cluster

KUBECTL = shutil.which("kubectl") or "kubectl"


def kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([KUBECTL, *args], input=input, capture_output=True, text=True,
                          check=check, timeout=120)


def get(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    result = kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    if not os.environ.get("KUBECONFIG"):
        pytest.fail("set KUBECONFIG to the cluster under test")
    kubectl("apply", "-f", str(CRD_PATH))
    kubectl("wait", "--for=condition=Established", "crd/llmservices.kvfleet.io", "--timeout=60s")
    name = f"kvfleet-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(namespace: str) -> Iterator[None]:
    # Only the test namespace: an operator installed in the cluster keeps the others.
    with operator_runner(namespace):
        yield


def apply(obj: dict[str, Any], namespace: str) -> None:
    obj = {**obj, "metadata": {**obj["metadata"], "namespace": namespace}}
    kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


@pytest.mark.parametrize("bad", BAD_SPECS, ids=lambda b: b.id)
def test_api_server_rejects_bad_llmservices(namespace: str, bad: BadSpec):
    body = bad.body()
    body["metadata"]["namespace"] = namespace
    result = kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(body),
                     check=False)
    assert result.returncode != 0, f"{bad.id} was admitted"
    field = bad.operator_error.split()[0].removeprefix("spec.").split("[")[0].split(".")[-1]
    assert field in result.stderr or bad.crd_error in result.stderr, result.stderr


def test_examples_get_children_the_api_server_accepts_and_gc_removes(namespace, operator):
    services = example_llmservices()
    secrets = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "KVFLEET_API_KEY": "x"}
    for secret in ("model-store", "qwen-api-key", "lora-store"):
        kubectl("create", "secret", "generic", secret, "-n", namespace,
                *[f"--from-literal={k}={v}" for k, v in secrets.items()])
    for service in services:
        apply(service, namespace)
    for service in services:
        name = service["metadata"]["name"]
        deployment = wait_for(lambda name=name: get("deployment", namespace, name), timeout=60,
                              what=f"the Deployment of {name}")
        assert deployment["metadata"]["ownerReferences"][0]["kind"] == "LLMService"
        assert get("service", namespace, name)["spec"]["ports"][0]["port"] == 80
        status = wait_for(lambda name=name: (get("llms", namespace, name) or {}).get("status"),
                          timeout=60, what=f"the status of {name}")
        assert status["url"] == f"http://{name}.{namespace}.svc.cluster.local/v1"
    assert get("hpa", namespace, "llama-8b") and get("pdb", namespace, "llama-8b")

    kubectl("delete", "llms", "llama-8b", "-n", namespace)
    wait_for(lambda: get("deployment", namespace, "llama-8b") is None, timeout=120,
             what="garbage collection of the Deployment")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_served_model_answers_on_its_openai_endpoint(namespace, operator):
    uri = os.environ.get("KVFLEET_E2E_MODEL_URI")
    if not uri:
        pytest.skip("set KVFLEET_E2E_MODEL_URI to a model the runtime image can serve")
    spec: dict[str, Any] = {"model": {"uri": uri, "name": "e2e"},
                            "resources": {"gpus": int(os.environ.get("KVFLEET_E2E_GPUS", "0"))}}
    if os.environ.get("KVFLEET_E2E_IMAGE"):
        spec["image"] = os.environ["KVFLEET_E2E_IMAGE"]
    apply({"apiVersion": "kvfleet.io/v1alpha1", "kind": "LLMService",
           "metadata": {"name": "e2e"}, "spec": spec}, namespace)
    kubectl("wait", "llms/e2e", "-n", namespace, "--for=condition=Ready", "--timeout=900s")
    port = free_port()
    forward = subprocess.Popen([KUBECTL, "port-forward", "-n", namespace, "svc/e2e", f"{port}:80"])
    try:
        def models() -> list[str] | None:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                return [m["id"] for m in reply.json()["data"]]
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.5)
                return None
        assert wait_for(models, timeout=60, what="/v1/models") == ["e2e"]
    finally:
        forward.terminate()
        forward.wait(10)
