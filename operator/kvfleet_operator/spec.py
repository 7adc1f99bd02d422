"""The typed LLMService spec: parsed from the custom resource, defaults applied, checked.

The API server already validates the CRD's OpenAPI schema and CEL rules; this
module checks the same rules again because the operator must never build
children from an object that slipped past a schema (an old CRD version, an
emulator without schema checks). Every error names the field and the allowed
values. The defaults here and the `default:` entries of crds/llmservice.yaml
are the same numbers (a test compares them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

API_GROUP = "kvfleet.io"
API_VERSION = "v1alpha1"
KIND = "LLMService"
PLURAL = "llmservices"

DEFAULT_IMAGE = "ghcr.io/kvfleet/kvfleet:0.1.0"
QUANTIZATIONS = ("none", "gptq", "awq", "fp8", "compressed-tensors", "modelopt")
BLOCK_SIZES = (8, 16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
SCHEDULING_POLICIES = ("fcfs", "priority")
MODEL_SCHEMES = ("s3://", "hf://", "pvc://", "/")
# An adapter's name is a DNS-1123 label short enough for its init container's name
# ("pull-adapter-" + name, at most 63 characters).
ADAPTER_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,48}[a-z0-9])?$")
MAX_ADAPTERS = 64
MAX_GLOBS = 64  # per list of spec.model.include / exclude (the CRD's maxItems)
# The same pattern the Kubernetes OpenAPI uses for resource.Quantity strings.
QUANTITY_RE = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
# A Service name is a DNS-1035 label, and every child is named after the LLMService.
DNS_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


class SpecError(ValueError):
    """The LLMService spec cannot be reconciled; the message names the field."""


def uri_scheme(uri: str) -> str:
    """One of s3, hf, pvc, path (a path baked into the image)."""
    return "path" if uri.startswith("/") else uri.split("://", 1)[0]


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    name: str
    revision: str | None = None
    # `kvfleet pull --include/--exclude` globs: include replaces the pull's default file choice,
    # exclude narrows it (only for a model the init container pulls: s3:// or hf://)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def scheme(self) -> str:
        return uri_scheme(self.uri)


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter (a PEFT folder) served beside the model under its own name."""

    name: str
    uri: str

    @property
    def scheme(self) -> str:
        return uri_scheme(self.uri)


@dataclass(frozen=True)
class S3Spec:
    endpoint: str | None = None
    region: str | None = None
    credentials_secret: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class HfSpec:
    """How the pull reaches the Hugging Face Hub for hf:// models and adapters (private and gated repos)."""

    token_secret: str | None = None
    endpoint: str | None = None     # a Hub mirror (HF_ENDPOINT)


@dataclass(frozen=True)
class EngineSpec:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    admission_headroom: int = 0
    # `kvfleet serve --scheduling-policy`: fcfs or priority; None leaves the runtime's default (fcfs)
    scheduling_policy: str | None = None
    # LoRA knobs, used only with spec.adapters; None leaves the choice to serve_command
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 1
    gpu_type: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int
    max_replicas: int
    target_tokens_per_second_per_replica: int
    scale_down_stabilization_seconds: int = 300


@dataclass(frozen=True)
class CacheSpec:
    """Where the pulled model lives: an emptyDir of `size`, or an existing PVC."""

    size: str = "50Gi"
    persistent_volume_claim: str | None = None


@dataclass(frozen=True)
class LLMServiceSpec:
    name: str
    namespace: str
    model: ModelSpec
    adapters: tuple[AdapterSpec, ...] = ()
    s3: S3Spec | None = None
    hf: HfSpec | None = None
    quantization: str = "none"
    engine: EngineSpec = field(default_factory=EngineSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    replicas: int = 1
    autoscaling: AutoscalingSpec | None = None
    cache: CacheSpec = field(default_factory=CacheSpec)
    image: str = DEFAULT_IMAGE
    api_key_secret: str | None = None

    @property
    def min_replicas(self) -> int:
        """Replicas the service keeps at least: the autoscaler's floor, else spec.replicas."""
        return self.autoscaling.min_replicas if self.autoscaling else self.replicas

    def secret_refs(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """(field, Secret name, keys the pods read from it) for each Secret the spec names; all must
        exist before children are made."""
        refs: list[tuple[str, str, tuple[str, ...]]] = []
        if self.s3 and self.s3.credentials_secret:
            refs.append(("spec.s3.credentialsSecret", self.s3.credentials_secret,
                         ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")))
        if self.hf and self.hf.token_secret:
            refs.append(("spec.hf.tokenSecret", self.hf.token_secret, ("HF_TOKEN",)))
        if self.api_key_secret:
            refs.append(("spec.apiKeySecret", self.api_key_secret, ("KVFLEET_API_KEY",)))
        return refs


# ---------------------------------------------------------------- field readers
# Each reader takes the parent mapping and the dotted path of the field, so an
# error message can always say exactly which field was wrong.


def _get(obj: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...],
         default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; a YAML `true` must not pass as a count.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise SpecError(f"{path}.{key} must be {_kind_name(kind)}; got {value!r}")
    if not isinstance(value, kind):
        raise SpecError(f"{path}.{key} must be {_kind_name(kind)}; got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             dict: "an object", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _int(obj: Mapping[str, Any], key: str, path: str, default: int | None,
         minimum: int, maximum: int | None = None) -> int | None:
    value = _get(obj, key, path, int, default)
    if value is None:
        return None
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise SpecError(f"{path}.{key} must be at least {minimum}{upper}; got {value}")
    return value


def _quantity(obj: Mapping[str, Any], key: str, path: str, default: str | None) -> str | None:
    value = _get(obj, key, path, (str, int), default)
    if value is None:
        return None
    if not QUANTITY_RE.match(str(value)):
        raise SpecError(f"{path}.{key} must be a Kubernetes quantity such as 8, 500m or 32Gi; "
                        f"got {value!r}")
    return str(value)


def _choice(value: Any, allowed: tuple[Any, ...], path: str) -> Any:
    if value not in allowed:
        raise SpecError(f"{path} must be one of {', '.join(map(str, allowed))}; got {value!r}")
    return value


def _optional_choice(obj: Mapping[str, Any], key: str, path: str,
                     allowed: tuple[str, ...]) -> str | None:
    """A string field with no default of its own: None when unset, else one of `allowed`."""
    value = _get(obj, key, path, str)
    return None if value is None else _choice(value, allowed, f"{path}.{key}")


# ---------------------------------------------------------------- sections


def _uri(raw: Mapping[str, Any], path: str) -> str:
    """The `uri` of a model or an adapter: one of the MODEL_SCHEMES, naming something."""
    uri = _get(raw, "uri", path, str)
    if not uri:
        raise SpecError(f"{path}.uri is required")
    if not uri.startswith(MODEL_SCHEMES):
        raise SpecError(f"{path}.uri must start with s3://, hf://, pvc:// or / "
                        f"(a path in the image); got {uri!r}")
    if uri.startswith(("s3://", "hf://", "pvc://")) and not uri.split("://", 1)[1].strip("/"):
        raise SpecError(f"{path}.uri must name a bucket, repository or claim; got {uri!r}")
    return uri


def _globs(raw: Mapping[str, Any], key: str, uri: str) -> tuple[str, ...]:
    """spec.model.include / exclude: a list of non-empty globs, each handed to `kvfleet pull` as
    `--KEY GLOB` (so none may start with '-', which the pull would read as an option)."""
    path = f"spec.model.{key}"
    globs = _get(raw, key, "spec.model", list, [])
    if len(globs) > MAX_GLOBS:
        raise SpecError(f"{path} holds at most {MAX_GLOBS} globs; got {len(globs)}")
    for i, glob in enumerate(globs):
        if not isinstance(glob, str) or not glob:
            raise SpecError(f"{path}[{i}] must be a non-empty string (a glob such as '*.safetensors'); "
                            f"got {glob!r}")
        if glob.startswith("-"):
            raise SpecError(f"{path}[{i}] must not start with '-' (kvfleet pull would read it as an "
                            f"option); got {glob!r}")
    if globs and uri_scheme(uri) not in ("s3", "hf"):
        raise SpecError(f"{path} is for an s3:// or hf:// model.uri (a model the init container "
                        f"pulls); got uri {uri!r}")
    return tuple(globs)


def _parse_model(spec: Mapping[str, Any]) -> ModelSpec:
    raw = _get(spec, "model", "spec", dict)
    if raw is None:
        raise SpecError("spec.model is required (with model.uri)")
    uri = _uri(raw, "spec.model")
    revision = _get(raw, "revision", "spec.model", str)
    if revision is not None and not (uri.startswith("hf://") and "@" not in uri):
        raise SpecError("spec.model.revision is for an hf:// model.uri without its own @REVISION; "
                        f"got uri {uri!r} and revision {revision!r}")
    last = uri.rstrip("/").rsplit("/", 1)[-1]
    name = _get(raw, "name", "spec.model", str) or (last.partition("@")[0] if uri.startswith("hf://")
                                                    else last)
    return ModelSpec(uri=uri, name=name, revision=revision,
                     include=_globs(raw, "include", uri), exclude=_globs(raw, "exclude", uri))


def _parse_adapters(spec: Mapping[str, Any], model: ModelSpec) -> tuple[AdapterSpec, ...]:
    raw = _get(spec, "adapters", "spec", list, [])
    if len(raw) > MAX_ADAPTERS:
        raise SpecError(f"spec.adapters holds at most {MAX_ADAPTERS} adapters; got {len(raw)}")
    adapters: list[AdapterSpec] = []
    for i, item in enumerate(raw):
        path = f"spec.adapters[{i}]"
        if not isinstance(item, dict):
            raise SpecError(f"{path} must be an object with name and uri; got {item!r}")
        name = _get(item, "name", path, str)
        if not name or not ADAPTER_NAME_RE.match(name):
            raise SpecError(f"{path}.name must be a DNS-1123 label (lowercase letters, digits, "
                            f"'-', at most 50 characters); got {name!r}")
        if name == model.name:
            raise SpecError(f"{path}.name must differ from the served model name "
                            f"{model.name!r} (requests pick the adapter by this name)")
        if any(a.name == name for a in adapters):
            raise SpecError(f"{path}.name {name!r} is used by another adapter; names must be unique")
        adapters.append(AdapterSpec(name=name, uri=_uri(item, path)))
    return tuple(adapters)


def _store_block(spec: Mapping[str, Any], scheme: str, model: ModelSpec,
                 adapters: tuple[AdapterSpec, ...]) -> Mapping[str, Any] | None:
    """spec.<scheme> (s3, hf: how the pulls reach that store), allowed only where the model or an
    adapter lives there; None when absent."""
    raw = _get(spec, scheme, "spec", dict)
    if raw is not None and model.scheme != scheme and not any(a.scheme == scheme for a in adapters):
        raise SpecError(f"spec.{scheme} is allowed only with an {scheme}:// model.uri or "
                        f"spec.adapters[].uri; got {model.uri!r}")
    return raw


def _parse_s3(spec: Mapping[str, Any], model: ModelSpec,
              adapters: tuple[AdapterSpec, ...]) -> S3Spec | None:
    raw = _store_block(spec, "s3", model, adapters)
    if raw is None:
        return None
    return S3Spec(
        endpoint=_get(raw, "endpoint", "spec.s3", str),
        region=_get(raw, "region", "spec.s3", str),
        credentials_secret=_get(raw, "credentialsSecret", "spec.s3", str),
        insecure=_get(raw, "insecure", "spec.s3", bool, False),
    )


def _parse_hf(spec: Mapping[str, Any], model: ModelSpec,
              adapters: tuple[AdapterSpec, ...]) -> HfSpec | None:
    raw = _store_block(spec, "hf", model, adapters)
    if raw is None:
        return None
    endpoint = _get(raw, "endpoint", "spec.hf", str)
    if endpoint is not None and not re.match(r"^https?://[^/]+", endpoint):
        raise SpecError(f"spec.hf.endpoint must be an http:// or https:// URL; got {endpoint!r}")
    return HfSpec(token_secret=_get(raw, "tokenSecret", "spec.hf", str), endpoint=endpoint)


def _parse_engine(spec: Mapping[str, Any]) -> EngineSpec:
    raw = _get(spec, "engine", "spec", dict, {})
    path = "spec.engine"
    defaults = EngineSpec()
    block_size = _get(raw, "blockSize", path, int, defaults.block_size)
    _choice(block_size, BLOCK_SIZES, f"{path}.blockSize")
    gpu_mem = _get(raw, "gpuMemoryUtilization", path, (int, float), defaults.gpu_memory_utilization)
    if not 0 < gpu_mem <= 1:
        raise SpecError(f"{path}.gpuMemoryUtilization must be in (0, 1]; got {gpu_mem}")
    extra = _get(raw, "extraArgs", path, list, [])
    if not all(isinstance(arg, str) for arg in extra):
        raise SpecError(f"{path}.extraArgs must be a list of strings; got {extra!r}")
    return EngineSpec(
        block_size=block_size,
        max_num_seqs=_int(raw, "maxNumSeqs", path, defaults.max_num_seqs, 1, 65536),
        max_num_batched_tokens=_int(raw, "maxNumBatchedTokens", path,
                                    defaults.max_num_batched_tokens, 1),
        max_model_len=_int(raw, "maxModelLen", path, None, 1),
        gpu_memory_utilization=float(gpu_mem),
        enable_prefix_caching=_get(raw, "enablePrefixCaching", path, bool,
                                   defaults.enable_prefix_caching),
        tensor_parallel_size=_int(raw, "tensorParallelSize", path,
                                  defaults.tensor_parallel_size, 1, 16),
        kv_cache_dtype=_choice(_get(raw, "kvCacheDtype", path, str, defaults.kv_cache_dtype),
                               KV_CACHE_DTYPES, f"{path}.kvCacheDtype"),
        admission_headroom=_int(raw, "admissionHeadroom", path, defaults.admission_headroom, 0),
        scheduling_policy=_optional_choice(raw, "schedulingPolicy", path, SCHEDULING_POLICIES),
        max_loras=_int(raw, "maxLoras", path, None, 1),
        max_lora_rank=_int(raw, "maxLoraRank", path, None, 1),
        max_cpu_loras=_int(raw, "maxCpuLoras", path, None, 1),
        extra_args=tuple(extra),
    )


def _parse_toleration(raw: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise SpecError(f"{path} must be an object; got {raw!r}")
    if "operator" in raw:
        _choice(raw["operator"], TOLERATION_OPERATORS, f"{path}.operator")
    if "effect" in raw:
        _choice(raw["effect"], TOLERATION_EFFECTS, f"{path}.effect")
    return dict(raw)


def _parse_resources(spec: Mapping[str, Any]) -> ResourcesSpec:
    raw = _get(spec, "resources", "spec", dict, {})
    path = "spec.resources"
    node_selector = _get(raw, "nodeSelector", path, dict, {})
    if not all(isinstance(v, str) for v in node_selector.values()):
        raise SpecError(f"{path}.nodeSelector values must be strings; got {node_selector!r}")
    tolerations = _get(raw, "tolerations", path, list, [])
    return ResourcesSpec(
        gpus=_int(raw, "gpus", path, ResourcesSpec.gpus, 0, 16),
        gpu_type=_get(raw, "gpuType", path, str),
        node_selector=dict(node_selector),
        tolerations=tuple(_parse_toleration(t, f"{path}.tolerations[{i}]")
                          for i, t in enumerate(tolerations)),
        cpu=_quantity(raw, "cpu", path, None),
        memory=_quantity(raw, "memory", path, None),
    )


def _parse_autoscaling(spec: Mapping[str, Any]) -> AutoscalingSpec | None:
    raw = _get(spec, "autoscaling", "spec", dict)
    if raw is None:
        return None
    path = "spec.autoscaling"
    for key in ("minReplicas", "maxReplicas", "targetTokensPerSecondPerReplica"):
        if key not in raw:
            raise SpecError(f"{path}.{key} is required when autoscaling is set")
    auto = AutoscalingSpec(
        min_replicas=_int(raw, "minReplicas", path, None, 1),
        max_replicas=_int(raw, "maxReplicas", path, None, 1),
        target_tokens_per_second_per_replica=_int(raw, "targetTokensPerSecondPerReplica",
                                                  path, None, 1),
        scale_down_stabilization_seconds=_int(raw, "scaleDownStabilizationSeconds", path,
                                              AutoscalingSpec.scale_down_stabilization_seconds,
                                              0, 3600),
    )
    if auto.min_replicas > auto.max_replicas:
        raise SpecError(f"{path}.minReplicas ({auto.min_replicas}) must be <= "
                        f"{path}.maxReplicas ({auto.max_replicas})")
    return auto


def _parse_cache(spec: Mapping[str, Any]) -> CacheSpec:
    raw = _get(spec, "cache", "spec", dict, {})
    if "size" in raw and "persistentVolumeClaim" in raw:
        raise SpecError("spec.cache takes either size (an emptyDir) or persistentVolumeClaim, "
                        "not both")
    return CacheSpec(
        size=_quantity(raw, "size", "spec.cache", CacheSpec.size),
        persistent_volume_claim=_get(raw, "persistentVolumeClaim", "spec.cache", str),
    )


def _check_lora(adapters: tuple[AdapterSpec, ...], engine: EngineSpec) -> None:
    knobs = {"maxLoras": engine.max_loras, "maxLoraRank": engine.max_lora_rank,
             "maxCpuLoras": engine.max_cpu_loras}
    if not adapters:
        given = [f"spec.engine.{key}" for key, value in knobs.items() if value is not None]
        if given:
            raise SpecError(f"{', '.join(given)}: allowed only with spec.adapters")
        return
    if (engine.max_cpu_loras is not None and engine.max_loras is not None
            and engine.max_cpu_loras < engine.max_loras):
        raise SpecError(f"spec.engine.maxCpuLoras ({engine.max_cpu_loras}) must be >= "
                        f"spec.engine.maxLoras ({engine.max_loras})")


def parse_spec(body: Mapping[str, Any]) -> LLMServiceSpec:
    """An LLMService object (as the API serves it) -> its typed, checked spec."""
    meta = body.get("metadata") or {}
    name, namespace = meta.get("name") or "", meta.get("namespace") or ""
    if not DNS_LABEL_RE.match(name):
        raise SpecError("metadata.name must be a DNS-1035 label (lowercase letters, digits, '-', "
                        f"at most 63 characters, starting with a letter); got {name!r}")
    spec = body.get("spec")
    if not isinstance(spec, dict):
        raise SpecError("spec is required (with spec.model.uri)")
    model = _parse_model(spec)
    adapters = _parse_adapters(spec, model)
    quantization = _choice(spec.get("quantization", "none"), QUANTIZATIONS, "spec.quantization")
    engine = _parse_engine(spec)
    resources = _parse_resources(spec)
    if engine.tensor_parallel_size > max(resources.gpus, 1):
        raise SpecError(f"spec.engine.tensorParallelSize ({engine.tensor_parallel_size}) must be "
                        f"<= spec.resources.gpus ({resources.gpus})")
    _check_lora(adapters, engine)
    image = _get(spec, "image", "spec", str, DEFAULT_IMAGE)
    return LLMServiceSpec(
        name=name,
        namespace=namespace,
        model=model,
        adapters=adapters,
        s3=_parse_s3(spec, model, adapters),
        hf=_parse_hf(spec, model, adapters),
        quantization=quantization,
        engine=engine,
        resources=resources,
        replicas=_int(spec, "replicas", "spec", 1, 0),
        autoscaling=_parse_autoscaling(spec),
        cache=_parse_cache(spec),
        image=image or DEFAULT_IMAGE,
        api_key_secret=_get(spec, "apiKeySecret", "spec", str),
    )
