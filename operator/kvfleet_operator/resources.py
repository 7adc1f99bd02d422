"""Pure builders: a typed LLMServiceSpec -> the manifests of its children.

No I/O here: every function returns plain dicts (the shape `kubectl get -o json`
shows), so they are unit-tested and validated against the official Kubernetes
schemas without a cluster. Ownership (ownerReferences) is added by apply.py.

The runtime is driven only through its command line (`kvfleet serve`,
`kvfleet pull`); the flags below are the runtime's fixed contract.
"""

from __future__ import annotations

from typing import Any

from kvfleet_operator.spec import AdapterSpec, LLMServiceSpec, uri_scheme

Manifest = dict[str, Any]

OPERATOR_NAME = "kvfleet-operator"
CONTAINER_PORT = 8000
SERVICE_PORT = 80
MODELS_DIR = "/models"
# Pulled adapters live in a volume of their own: /models may be a read-only claim (pvc://).
ADAPTERS_DIR = "/adapters"
# A pvc:// adapter on a claim other than the model's is mounted read-only under here.
ADAPTER_CLAIMS_DIR = "/adapter-claims"
# --max-loras when the spec leaves it out: one GPU slot per adapter, up to this many
# (every slot holds max_lora_rank-sized weights on the GPU whether used or not).
DEFAULT_MAX_LORAS_CAP = 4
TOKENS_PER_SECOND_METRIC = "kvfleet_generation_tokens_per_second"
# Seconds the server gets to finish in-flight requests after SIGTERM.
SHUTDOWN_TIMEOUT_SECONDS = 30
# The preStop pause lets Service endpoints drop the pod before SIGTERM arrives.
PRESTOP_SLEEP_SECONDS = 10
# Loading a large model (pull + weights to GPU + KV cache sizing) can take many
# minutes; the startup probe allows 30 of them before liveness takes over.
STARTUP_PROBE_PERIOD_SECONDS = 10
STARTUP_PROBE_FAILURES = 180
RUN_AS_USER = 1000
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = "kvfleet.io/llmservice"


def selector_labels(spec: LLMServiceSpec) -> dict[str, str]:
    """The labels that pick this service's pods; never change (Deployment selectors are immutable)."""
    return {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/instance": spec.name}


def labels(spec: LLMServiceSpec) -> dict[str, str]:
    return {
        **selector_labels(spec),
        "app.kubernetes.io/component": "inference",
        LABEL_MANAGED_BY: OPERATOR_NAME,
        LABEL_OWNER: spec.name,
    }


def _metadata(spec: LLMServiceSpec) -> dict[str, Any]:
    return {"name": spec.name, "namespace": spec.namespace, "labels": labels(spec)}


# ---------------------------------------------------------------- runtime command lines


def _claim_of(uri: str) -> tuple[str, str]:
    """pvc://CLAIM/SUB/PATH -> (CLAIM, SUB/PATH)."""
    claim, _, sub_path = uri.removeprefix("pvc://").partition("/")
    return claim, sub_path.strip("/")


def _under(root: str, sub_path: str) -> str:
    return f"{root}/{sub_path}" if sub_path else root


def model_path(spec: LLMServiceSpec) -> str:
    """Where `kvfleet serve` finds the model inside the container."""
    model = spec.model
    if model.scheme == "path":
        return model.uri
    if model.scheme == "pvc":
        # pvc://CLAIM/SUB/PATH: the claim is mounted at /models.
        return _under(MODELS_DIR, _claim_of(model.uri)[1])
    return MODELS_DIR


def adapter_claims(spec: LLMServiceSpec) -> dict[str, str]:
    """Claim -> mount path of every pvc:// adapter's claim (the model's claim is /models)."""
    model_claim = _claim_of(spec.model.uri)[0] if spec.model.scheme == "pvc" else None
    claims: dict[str, str] = {}
    for adapter in spec.adapters:
        if adapter.scheme == "pvc":
            claim = _claim_of(adapter.uri)[0]
            claims.setdefault(claim, MODELS_DIR if claim == model_claim
                              else f"{ADAPTER_CLAIMS_DIR}/{claim}")
    return claims


def adapter_path(spec: LLMServiceSpec, adapter: AdapterSpec) -> str:
    """Where `kvfleet serve` finds an adapter's PEFT folder inside the container."""
    if adapter.scheme == "path":
        return adapter.uri
    if adapter.scheme == "pvc":
        claim, sub_path = _claim_of(adapter.uri)
        return _under(adapter_claims(spec)[claim], sub_path)
    return f"{ADAPTERS_DIR}/{adapter.name}"


def max_loras(spec: LLMServiceSpec) -> int:
    """--max-loras: the spec's, else one slot per adapter up to the cap (and maxCpuLoras)."""
    engine = spec.engine
    if engine.max_loras is not None:
        return engine.max_loras
    return min(len(spec.adapters), DEFAULT_MAX_LORAS_CAP, engine.max_cpu_loras or len(spec.adapters))


def lora_args(spec: LLMServiceSpec) -> list[str]:
    """The `kvfleet serve` flags that serve spec.adapters; none without adapters."""
    if not spec.adapters:
        return []
    engine = spec.engine
    args = ["--enable-lora", "--lora-modules",
            *(f"{a.name}={adapter_path(spec, a)}" for a in spec.adapters),
            "--max-loras", str(max_loras(spec))]
    if engine.max_lora_rank is not None:
        args += ["--max-lora-rank", str(engine.max_lora_rank)]
    if engine.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(engine.max_cpu_loras)]
    return args


def serve_command(spec: LLMServiceSpec) -> list[str]:
    engine = spec.engine
    command = [
        "kvfleet", "serve", model_path(spec),
        "--host", "0.0.0.0",
        "--port", str(CONTAINER_PORT),
        "--served-model-name", spec.model.name,
        "--block-size", str(engine.block_size),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
    ]
    if engine.max_model_len is not None:
        command += ["--max-model-len", str(engine.max_model_len)]
    command += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    if spec.quantization != "none":
        command += ["--quantization", spec.quantization]
    if engine.kv_cache_dtype != "auto":
        command += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.admission_headroom:
        command += ["--admission-headroom", str(engine.admission_headroom)]
    if engine.scheduling_policy is not None:
        command += ["--scheduling-policy", engine.scheduling_policy]
    command += [
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_SECONDS),
    ]
    return command + lora_args(spec) + list(engine.extra_args)


def pull_source(spec: LLMServiceSpec) -> str | None:
    """What the init container pulls, or None when the model is already on a volume or in the image."""
    model = spec.model
    if model.scheme == "s3":
        return model.uri
    if model.scheme == "hf":
        return f"{model.uri}@{model.revision}" if model.revision else model.uri
    return None


def pulled_adapters(spec: LLMServiceSpec) -> list[AdapterSpec]:
    """The adapters an init container pulls into ADAPTERS_DIR (s3:// and hf://)."""
    return [a for a in spec.adapters if a.scheme in ("s3", "hf")]


def pull_command(spec: LLMServiceSpec, source: str, dest: str, *,
                 include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> list[str]:
    """`kvfleet pull SOURCE DEST`, with the spec's S3 options for an s3:// SOURCE and one
    `--include GLOB` / `--exclude GLOB` per glob."""
    command = ["kvfleet", "pull", source, dest]
    s3 = spec.s3 if uri_scheme(source) == "s3" else None
    if s3 and s3.region:
        command += ["--region", s3.region]
    if s3 and s3.insecure:
        command += ["--no-verify-ssl"]
    for option, globs in (("--include", include), ("--exclude", exclude)):
        command += [arg for glob in globs for arg in (option, glob)]
    return command


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def pull_env(spec: LLMServiceSpec, source: str) -> list[dict[str, Any]]:
    """The pull's env: each store's credentials only for a SOURCE in that store."""
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}]
    s3 = spec.s3 if uri_scheme(source) == "s3" else None
    if s3 and s3.credentials_secret:
        env += [_secret_env(key, s3.credentials_secret, key)
                for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    if s3 and s3.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": s3.endpoint})
    if s3 and s3.region:
        env.append({"name": "AWS_REGION", "value": s3.region})
    if uri_scheme(source) == "hf":
        # The runtime image sets HF_HUB_OFFLINE=1 for the server; this pull is meant to reach the Hub.
        env.append({"name": "HF_HUB_OFFLINE", "value": "0"})
        if spec.hf and spec.hf.endpoint:
            env.append({"name": "HF_ENDPOINT", "value": spec.hf.endpoint})
        if spec.hf and spec.hf.token_secret:
            env.append(_secret_env("HF_TOKEN", spec.hf.token_secret, "HF_TOKEN"))
    return env


def serve_env(spec: LLMServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}]
    if spec.api_key_secret:
        env.append(_secret_env("KVFLEET_API_KEY", spec.api_key_secret, "KVFLEET_API_KEY"))
    return env


# ---------------------------------------------------------------- pod pieces


def _container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _resource_requirements(spec: LLMServiceSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpu:
        requests["cpu"] = limits["cpu"] = res.cpu
    if res.memory:
        requests["memory"] = limits["memory"] = res.memory
    if res.gpus:
        limits[GPU_RESOURCE] = str(res.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _health_probe(period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _volumes(spec: LLMServiceSpec) -> list[dict[str, Any]]:
    if spec.model.scheme == "pvc":
        claim = _claim_of(spec.model.uri)[0]
        models = {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    elif spec.cache.persistent_volume_claim:
        models = {"persistentVolumeClaim": {"claimName": spec.cache.persistent_volume_claim}}
    else:
        models = {"emptyDir": {"sizeLimit": spec.cache.size}}
    volumes = [
        {"name": "models", **models},
        # NCCL (tensor parallelism) and torch dataloaders need a large /dev/shm.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        # The root filesystem is read-only; Triton and torch compile caches go here.
        {"name": "tmp", "emptyDir": {}},
    ]
    if pulled_adapters(spec):
        volumes.append({"name": "adapters", "emptyDir": {}})
    volumes += [{"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
                for name, claim, _ in _adapter_claim_volumes(spec)]
    return volumes


def _adapter_claim_volumes(spec: LLMServiceSpec) -> list[tuple[str, str, str]]:
    """(volume name, claim, mount path) of each adapter claim other than the model's."""
    claims = [(claim, path) for claim, path in adapter_claims(spec).items() if path != MODELS_DIR]
    return [(f"adapter-claim-{i}", claim, path) for i, (claim, path) in enumerate(claims)]


def _volume_mounts(spec: LLMServiceSpec, *, read_only_models: bool) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "models", "mountPath": MODELS_DIR, "readOnly": read_only_models},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if pulled_adapters(spec):
        mounts.append({"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": read_only_models})
    mounts += [{"name": name, "mountPath": path, "readOnly": True}
               for name, _, path in _adapter_claim_volumes(spec)]
    return mounts


def _tolerations(spec: LLMServiceSpec) -> list[dict[str, Any]]:
    tolerations = [dict(t) for t in spec.resources.tolerations]
    # GPU node pools are commonly tainted with nvidia.com/gpu; GPU pods must tolerate it.
    if spec.resources.gpus and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def _node_selector(spec: LLMServiceSpec) -> dict[str, str]:
    selector = dict(spec.resources.node_selector)
    if spec.resources.gpu_type:
        selector[GPU_PRODUCT_LABEL] = spec.resources.gpu_type
    return selector


def _runtime_container(spec: LLMServiceSpec) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "kvfleet",
        "image": spec.image,
        "command": serve_command(spec),
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}],
        "env": serve_env(spec),
        "readinessProbe": _health_probe(period=5, failures=3),
        "livenessProbe": _health_probe(period=10, failures=6),
        "startupProbe": _health_probe(period=STARTUP_PROBE_PERIOD_SECONDS,
                                      failures=STARTUP_PROBE_FAILURES),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": _container_security_context(),
        "volumeMounts": _volume_mounts(spec, read_only_models=True),
    }
    resources = _resource_requirements(spec)
    if resources:
        container["resources"] = resources
    return container


def _pull_container(spec: LLMServiceSpec, name: str, source: str, dest: str, *,
                    include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "name": name,
        "image": spec.image,
        "command": pull_command(spec, source, dest, include=include, exclude=exclude),
        "env": pull_env(spec, source),
        "securityContext": _container_security_context(),
        "volumeMounts": _volume_mounts(spec, read_only_models=False),
    }


def _pull_containers(spec: LLMServiceSpec) -> list[dict[str, Any]]:
    """The model's pull (with the spec's globs), then one per pulled adapter (init containers run
    in order). The globs are part of the pod template, so changing them rolls the Deployment."""
    containers = []
    source = pull_source(spec)
    if source is not None:
        containers.append(_pull_container(spec, "pull-model", source, MODELS_DIR,
                                          include=spec.model.include, exclude=spec.model.exclude))
    containers += [_pull_container(spec, f"pull-adapter-{a.name}", a.uri, adapter_path(spec, a))
                   for a in pulled_adapters(spec)]
    return containers


def pod_template(spec: LLMServiceSpec) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": SHUTDOWN_TIMEOUT_SECONDS + PRESTOP_SLEEP_SECONDS + 5,
        "containers": [_runtime_container(spec)],
        "volumes": _volumes(spec),
    }
    init_containers = _pull_containers(spec)
    if init_containers:
        pod_spec["initContainers"] = init_containers
    node_selector = _node_selector(spec)
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    tolerations = _tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {
        "metadata": {
            "labels": labels(spec),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(CONTAINER_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


# ---------------------------------------------------------------- children


def build_deployment(spec: LLMServiceSpec) -> Manifest:
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(spec)},
        # Never drop below the serving capacity during a rollout: a new pod
        # loads its model before an old one goes away.
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": pod_template(spec),
    }
    # With autoscaling the HPA owns .spec.replicas; writing it here would fight the HPA.
    if spec.autoscaling is None:
        deployment_spec["replicas"] = spec.replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(spec),
            "spec": deployment_spec}


def build_service(spec: LLMServiceSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec),
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }


def decimal_quantity(value: int) -> str:
    """An integer in the API server's canonical quantity form (2000 -> "2k"), so the
    live object reads back exactly what was applied and no needless patch follows."""
    suffixes = ("", "k", "M", "G", "T", "P", "E")
    index = 0
    while value and value % 1000 == 0 and index < len(suffixes) - 1:
        value //= 1000
        index += 1
    return f"{value}{suffixes[index]}"


def build_hpa(spec: LLMServiceSpec) -> Manifest | None:
    auto = spec.autoscaling
    if auto is None:
        return None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(spec),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": TOKENS_PER_SECOND_METRIC},
                    "target": {"type": "AverageValue",
                               "averageValue": decimal_quantity(
                                   auto.target_tokens_per_second_per_replica)},
                },
            }],
            "behavior": {"scaleDown": {
                "stabilizationWindowSeconds": auto.scale_down_stabilization_seconds}},
        },
    }


def build_pdb(spec: LLMServiceSpec) -> Manifest | None:
    # With one replica a PDB of maxUnavailable 1 protects nothing, and
    # minAvailable 1 would block node drains forever.
    if spec.min_replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(spec)}},
    }


# Fields a builder may stop setting because another controller takes them over:
# when autoscaling is switched on, the HPA owns Deployment .spec.replicas, and
# removing the field would reset the Deployment to 1 replica before the HPA acts.
HANDED_OVER: dict[str, tuple[tuple[str, ...], ...]] = {"Deployment": (("spec", "replicas"),)}


def build_children(spec: LLMServiceSpec) -> dict[str, Manifest | None]:
    """Kind -> desired manifest; None means that child must not exist."""
    return {
        "Deployment": build_deployment(spec),
        "Service": build_service(spec),
        "HorizontalPodAutoscaler": build_hpa(spec),
        "PodDisruptionBudget": build_pdb(spec),
    }


def service_url(spec: LLMServiceSpec) -> str:
    return f"http://{spec.name}.{spec.namespace}.svc.cluster.local/v1"
