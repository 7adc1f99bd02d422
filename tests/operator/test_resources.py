"""resources.py: spec -> child manifests, each validated against the official Kubernetes schemas."""

from __future__ import annotations

import kubernetes_validate
import pytest
from kvfleet_operator.resources import (
    build_children,
    build_deployment,
    build_hpa,
    build_pdb,
    build_service,
    decimal_quantity,
    serve_command,
    service_url,
)
from kvfleet_operator.spec import parse_spec
from operator_harness import example_llmservices, minimal_llmservice

# The oldest version whose schema has every field we emit (preStop sleep: 1.30), and the newest.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")


TWO_ADAPTERS = minimal_llmservice(
    model={"uri": "s3://models/llama", "name": "llama"},
    s3={"endpoint": "http://seaweedfs:8333", "region": "eu-1", "credentialsSecret": "store"},
    adapters=[{"name": "sql", "uri": "s3://adapters/llama-sql"},
              {"name": "chat-de", "uri": "s3://adapters/llama-chat-de/"}],
    engine={"maxLoraRank": 64})
HF_GATED = minimal_llmservice(
    model={"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "revision": "main", "name": "llama"},
    adapters=[{"name": "sql", "uri": "hf://org/llama-sql"}, {"name": "chat-de", "uri": "s3://adapters/de"}],
    hf={"tokenSecret": "hf-token"}, s3={"credentialsSecret": "store", "region": "eu-1", "insecure": True})
ADAPTERS_ON_CLAIMS = minimal_llmservice(
    model={"uri": "pvc://weights/llama"},
    adapters=[{"name": "same-claim", "uri": "pvc://weights/adapters/sql"},
              {"name": "other-claim", "uri": "pvc://lora-store/de"},
              {"name": "other-claim-too", "uri": "pvc://lora-store/fr"},
              {"name": "baked", "uri": "/opt/adapters/it"}],
    engine={"maxCpuLoras": 3})


def spec_of(**spec):
    return parse_spec(minimal_llmservice(**spec))


def pod_spec(spec):
    return build_deployment(spec)["spec"]["template"]["spec"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("body", example_llmservices() + [minimal_llmservice(), TWO_ADAPTERS,
                                                            ADAPTERS_ON_CLAIMS, HF_GATED],
                         ids=lambda b: f"{b['metadata']['name']}-{len(b['spec'].get('adapters', []))}")
def test_every_child_validates_against_the_official_schema(body, version):
    children = [m for m in build_children(parse_spec(body)).values() if m is not None]
    assert {m["kind"] for m in children} >= {"Deployment", "Service"}
    for manifest in children:
        kubernetes_validate.validate(manifest, version, strict=True)


def test_serve_command_carries_every_engine_flag():
    spec = spec_of(model={"uri": "s3://b/llama", "name": "llama"}, quantization="awq",
                   engine={"blockSize": 32, "maxNumSeqs": 12, "maxNumBatchedTokens": 4096,
                           "maxModelLen": 2048, "gpuMemoryUtilization": 0.85,
                           "enablePrefixCaching": False, "tensorParallelSize": 2,
                           "kvCacheDtype": "fp8", "admissionHeadroom": 512,
                           "schedulingPolicy": "priority",
                           "extraArgs": ["--extra", "1"]},
                   resources={"gpus": 2})
    command = serve_command(spec)
    assert command[:3] == ["kvfleet", "serve", "/models"]
    expected = {"--host": "0.0.0.0", "--port": "8000", "--served-model-name": "llama",
                "--block-size": "32", "--max-num-seqs": "12", "--max-num-batched-tokens": "4096",
                "--max-model-len": "2048", "--gpu-memory-utilization": "0.85",
                "--quantization": "awq", "--tensor-parallel-size": "2", "--shutdown-timeout": "30",
                "--kv-cache-dtype": "fp8", "--admission-headroom": "512",
                "--scheduling-policy": "priority"}
    assert {name: flag(command, name) for name in expected} == expected
    assert "--no-enable-prefix-caching" in command and "--enable-prefix-caching" not in command
    assert command[-2:] == ["--extra", "1"]
    assert build_deployment(spec)["spec"]["template"]["spec"]["containers"][0]["command"] == command


def test_no_quantization_and_no_max_model_len_add_no_flag():
    command = serve_command(spec_of())
    assert "--quantization" not in command and "--max-model-len" not in command
    assert "--kv-cache-dtype" not in command and "--admission-headroom" not in command
    assert "--scheduling-policy" not in command
    assert "--enable-prefix-caching" in command


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_set_scheduling_policy_is_passed_as_given(policy):
    command = serve_command(spec_of(engine={"schedulingPolicy": policy}))
    assert command.count("--scheduling-policy") == 1 and flag(command, "--scheduling-policy") == policy


def test_s3_model_is_pulled_by_an_init_container_with_secret_credentials_and_endpoint():
    spec = spec_of(model={"uri": "s3://bucket/llama"},
                   s3={"endpoint": "http://seaweedfs:8333", "region": "eu-1",
                       "credentialsSecret": "store", "insecure": True})
    (init,) = pod_spec(spec)["initContainers"]
    assert init["command"] == ["kvfleet", "pull", "s3://bucket/llama", "/models",
                               "--region", "eu-1", "--no-verify-ssl"]
    env = {e["name"]: e for e in init["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "store", "key": key}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://seaweedfs:8333"
    mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": False}
    assert pod_spec(spec)["volumes"][0] == {"name": "models", "emptyDir": {"sizeLimit": "50Gi"}}


def test_hf_model_is_pulled_at_its_revision_and_pvc_or_image_models_are_not_pulled():
    hf = spec_of(model={"uri": "hf://org/model", "revision": "v2"})
    assert pod_spec(hf)["initContainers"][0]["command"][2] == "hf://org/model@v2"
    pvc = spec_of(model={"uri": "pvc://weights/llama/8b"})
    assert "initContainers" not in pod_spec(pvc)
    assert serve_command(pvc)[2] == "/models/llama/8b"
    assert pod_spec(pvc)["volumes"][0]["persistentVolumeClaim"] == {"claimName": "weights",
                                                                     "readOnly": True}
    baked = spec_of(model={"uri": "/opt/models/llama"})
    assert "initContainers" not in pod_spec(baked) and serve_command(baked)[2] == "/opt/models/llama"


def test_hf_token_secret_reaches_the_hf_pulls_and_s3_options_the_s3_pulls():
    pod = pod_spec(parse_spec(HF_GATED))
    assert [c["command"][1:] for c in pod["initContainers"]] == [
        ["pull", "hf://meta-llama/Llama-3.1-8B-Instruct@main", "/models"],
        ["pull", "hf://org/llama-sql", "/adapters/sql"],
        ["pull", "s3://adapters/de", "/adapters/chat-de", "--region", "eu-1", "--no-verify-ssl"]]
    hf_model, hf_adapter, s3_adapter = ({e["name"]: e for e in init["env"]} for init in pod["initContainers"])
    for env in (hf_model, hf_adapter):
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
        assert env["HF_HUB_OFFLINE"]["value"] == "0"     # the image's HF_HUB_OFFLINE=1 is for the server
        assert "AWS_ACCESS_KEY_ID" not in env and "AWS_REGION" not in env
    assert "HF_TOKEN" not in s3_adapter and "HF_HUB_OFFLINE" not in s3_adapter
    assert s3_adapter["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "store", "key": "AWS_ACCESS_KEY_ID"}
    # the server itself never gets the token
    assert "HF_TOKEN" not in {e["name"] for e in pod["containers"][0]["env"]}
    without = pod_spec(spec_of(model={"uri": "hf://org/public-model"}))
    assert not {"HF_TOKEN", "HF_ENDPOINT"} & {e["name"] for e in without["initContainers"][0]["env"]}


def test_hf_endpoint_names_the_mirror_the_hf_pulls_read():
    pod = pod_spec(spec_of(model={"uri": "hf://org/public-model"},
                           hf={"endpoint": "https://hf-mirror.internal"}))
    env = {e["name"]: e for e in pod["initContainers"][0]["env"]}
    assert env["HF_ENDPOINT"] == {"name": "HF_ENDPOINT", "value": "https://hf-mirror.internal"}
    assert "HF_ENDPOINT" not in {e["name"] for e in pod["containers"][0]["env"]}


def test_cache_pvc_replaces_the_empty_dir():
    spec = spec_of(cache={"persistentVolumeClaim": "model-cache"})
    assert pod_spec(spec)["volumes"][0] == {"name": "models",
                                            "persistentVolumeClaim": {"claimName": "model-cache"}}


def test_gpus_node_selection_and_tolerations():
    spec = spec_of(resources={"gpus": 4, "gpuType": "NVIDIA-H200", "nodeSelector": {"pool": "a"},
                              "tolerations": [{"key": "dedicated", "operator": "Equal",
                                               "value": "llm", "effect": "NoSchedule"}],
                              "cpu": "8", "memory": "64Gi"})
    pod = pod_spec(spec)
    container = pod["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "8", "memory": "64Gi"},
                                      "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "4"}}
    assert pod["nodeSelector"] == {"pool": "a", "nvidia.com/gpu.product": "NVIDIA-H200"}
    assert [t["key"] for t in pod["tolerations"]] == ["dedicated", "nvidia.com/gpu"]
    cpu_only = pod_spec(spec_of(resources={"gpus": 0}))
    assert "resources" not in cpu_only["containers"][0] and "tolerations" not in cpu_only


def test_runtime_container_is_probed_non_root_scraped_and_drained():
    spec = spec_of(apiKeySecret="api-key")
    template = build_deployment(spec)["spec"]["template"]
    pod, container = template["spec"], template["spec"]["containers"][0]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60  # model loading
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert pod["terminationGracePeriodSeconds"] > 30 + container["lifecycle"]["preStop"]["sleep"]["seconds"]
    env = {e["name"]: e for e in container["env"]}
    assert env["KVFLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "api-key",
                                                                   "key": "KVFLEET_API_KEY"}


def test_service_exposes_port_80_named_http_to_the_pods():
    spec = spec_of()
    service = build_service(spec)
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http",
                                         "protocol": "TCP"}]
    assert service["spec"]["selector"] == build_deployment(spec)["spec"]["selector"]["matchLabels"]
    assert service_url(spec) == "http://demo.default.svc.cluster.local/v1"


def test_autoscaling_makes_an_hpa_on_tokens_per_second_and_leaves_replicas_to_it():
    spec = spec_of(autoscaling={"minReplicas": 2, "maxReplicas": 6,
                                "targetTokensPerSecondPerReplica": 1500,
                                "scaleDownStabilizationSeconds": 120})
    hpa = build_hpa(spec)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "demo"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric == {"type": "Pods", "pods": {
        "metric": {"name": "kvfleet_generation_tokens_per_second"},
        "target": {"type": "AverageValue", "averageValue": "1500"}}}
    # The API server stores quantities canonically; applying that form avoids needless patches.
    assert [decimal_quantity(v) for v in (1, 999, 1000, 2000, 1500, 3_000_000, 10**18)] == \
        ["1", "999", "1k", "2k", "1500", "3M", "1E"]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120
    assert "replicas" not in build_deployment(spec)["spec"]
    assert build_pdb(spec)["spec"]["maxUnavailable"] == 1


def test_fixed_replicas_make_no_hpa_and_a_pdb_only_above_one():
    assert build_hpa(spec_of(replicas=3)) is None
    assert build_deployment(spec_of(replicas=3))["spec"]["replicas"] == 3
    assert build_pdb(spec_of(replicas=3)) is not None
    assert build_pdb(spec_of(replicas=1)) is None
    assert build_pdb(spec_of(replicas=0)) is None


def test_children_share_labels_and_a_stable_selector():
    spec = spec_of()
    for manifest in filter(None, build_children(spec).values()):
        assert manifest["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvfleet-operator"
        assert manifest["metadata"]["labels"]["kvfleet.io/llmservice"] == "demo"
        assert (manifest["metadata"]["name"], manifest["metadata"]["namespace"]) == ("demo", "default")
    changed = spec_of(quantization="fp8", replicas=4)
    assert (build_deployment(changed)["spec"]["selector"]
            == build_deployment(spec)["spec"]["selector"])  # Deployment selectors are immutable


def test_adapters_are_pulled_after_the_model_and_served_with_lora_flags():
    spec = parse_spec(TWO_ADAPTERS)
    pod = pod_spec(spec)
    assert [c["name"] for c in pod["initContainers"]] == [
        "pull-model", "pull-adapter-sql", "pull-adapter-chat-de"]
    assert [c["command"] for c in pod["initContainers"]] == [
        ["kvfleet", "pull", "s3://models/llama", "/models", "--region", "eu-1"],
        ["kvfleet", "pull", "s3://adapters/llama-sql", "/adapters/sql", "--region", "eu-1"],
        ["kvfleet", "pull", "s3://adapters/llama-chat-de/", "/adapters/chat-de", "--region", "eu-1"]]
    for init in pod["initContainers"]:  # the same S3 endpoint and keys as the model's pull
        env = {e["name"]: e for e in init["env"]}
        assert env["AWS_ENDPOINT_URL"]["value"] == "http://seaweedfs:8333"
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "store"
        assert {"name": "adapters", "mountPath": "/adapters", "readOnly": False} in init["volumeMounts"]
    assert {"name": "adapters", "emptyDir": {}} in pod["volumes"]
    container = pod["containers"][0]
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in container["volumeMounts"]
    command = container["command"]
    assert command[command.index("--enable-lora"):] == [
        "--enable-lora", "--lora-modules", "sql=/adapters/sql", "chat-de=/adapters/chat-de",
        "--max-loras", "2", "--max-lora-rank", "64"]


def test_no_adapters_leave_the_pod_as_it_was():
    pod = pod_spec(spec_of())
    assert [c["name"] for c in pod["initContainers"]] == ["pull-model"]
    assert [v["name"] for v in pod["volumes"]] == ["models", "dshm", "tmp"]
    assert not {"--enable-lora", "--lora-modules", "--max-loras"} & set(pod["containers"][0]["command"])


def test_adapters_on_claims_or_in_the_image_are_mounted_not_pulled():
    spec = parse_spec(ADAPTERS_ON_CLAIMS)
    pod = pod_spec(spec)
    assert "initContainers" not in pod
    command = pod["containers"][0]["command"]
    assert command[command.index("--lora-modules") + 1:command.index("--max-loras")] == [
        "same-claim=/models/adapters/sql", "other-claim=/adapter-claims/lora-store/de",
        "other-claim-too=/adapter-claims/lora-store/fr", "baked=/opt/adapters/it"]
    # four adapters, capped at maxCpuLoras (the runtime wants max_cpu_loras >= max_loras)
    assert (flag(command, "--max-loras"), flag(command, "--max-cpu-loras")) == ("3", "3")
    assert "--max-lora-rank" not in command
    # one read-only volume for the other claim; the model's claim is not mounted twice
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert pod["volumes"][3:] == [{"name": "adapter-claim-0", "persistentVolumeClaim": {
        "claimName": "lora-store", "readOnly": True}}]
    assert {"name": "adapter-claim-0", "mountPath": "/adapter-claims/lora-store", "readOnly": True} \
        in pod["containers"][0]["volumeMounts"]


@pytest.mark.parametrize("num_adapters, max_loras", [(1, "1"), (3, "3"), (4, "4"), (9, "4")])
def test_max_loras_defaults_to_one_slot_per_adapter_up_to_four(num_adapters, max_loras):
    spec = spec_of(adapters=[{"name": f"a{i}", "uri": f"s3://models/a{i}"} for i in range(num_adapters)])
    assert flag(serve_command(spec), "--max-loras") == max_loras
    assert flag(serve_command(spec_of(adapters=[{"name": "a", "uri": "/a"}],
                                      engine={"maxLoras": 7})), "--max-loras") == "7"


def test_changing_the_adapters_changes_the_pod_template():
    before = build_deployment(parse_spec(TWO_ADAPTERS))["spec"]["template"]
    body = {**TWO_ADAPTERS, "spec": {**TWO_ADAPTERS["spec"],
                                     "adapters": [{"name": "sql", "uri": "s3://adapters/llama-sql-v2"}]}}
    after = build_deployment(parse_spec(body))["spec"]["template"]
    assert before != after  # a new template: the Deployment rolls
    assert [c["name"] for c in after["spec"]["initContainers"]] == ["pull-model", "pull-adapter-sql"]


def test_model_globs_reach_the_model_pull_as_include_and_exclude_options_and_no_adapter_pull():
    spec = spec_of(model={"uri": "s3://models/llama", "include": ["*.safetensors", "*.json"],
                          "exclude": ["original/*"]},
                   s3={"region": "eu-1"}, adapters=[{"name": "sql", "uri": "s3://adapters/sql"}])
    model_pull, adapter_pull = (c["command"] for c in pod_spec(spec)["initContainers"])
    assert model_pull == ["kvfleet", "pull", "s3://models/llama", "/models", "--region", "eu-1",
                          "--include", "*.safetensors", "--include", "*.json", "--exclude", "original/*"]
    assert adapter_pull == ["kvfleet", "pull", "s3://adapters/sql", "/adapters/sql", "--region", "eu-1"]
    hf = spec_of(model={"uri": "hf://org/model", "revision": "v2", "exclude": ["*.gguf"]})
    assert pod_spec(hf)["initContainers"][0]["command"][2:] == ["hf://org/model@v2", "/models",
                                                                "--exclude", "*.gguf"]
    # a changed list changes the pod template, so the Deployment rolls
    narrower = spec_of(model={"uri": "s3://models/llama", "include": ["*.safetensors"]},
                       s3={"region": "eu-1"}, adapters=[{"name": "sql", "uri": "s3://adapters/sql"}])
    assert pod_spec(narrower) != pod_spec(spec)
