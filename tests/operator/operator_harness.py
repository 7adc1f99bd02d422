"""Shared pieces of the operator tests: paths, the CRD, the examples, the runner, bad specs.

(Kept out of conftest.py so test modules can import them without clashing with
the other test folders' conftest modules.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kopf.testing import KopfRunner

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "llmservice.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def example_docs(path: Path, namespace: str = "default") -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for doc in docs:
        doc["metadata"].setdefault("namespace", namespace)
    return docs


def example_llmservices() -> list[dict[str, Any]]:
    return [doc for path in EXAMPLES for doc in example_docs(path) if doc["kind"] == "LLMService"]


def operator_runner(namespace: str | None = None) -> KopfRunner:
    """The real operator module under kopf, as `kvfleet-operator` runs it (minus liveness)."""
    scope = ["--namespace", namespace] if namespace else ["--all-namespaces"]
    return KopfRunner(["run", "--standalone", *scope, "-m", "kvfleet_operator.main"], timeout=30)


def minimal_llmservice(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "demo", "namespace": "default"},
            "spec": {"model": {"uri": "s3://models/llama"}, **spec}}


@dataclass(frozen=True)
class BadSpec:
    """An LLMService the CRD must reject, and what each layer says about it."""

    id: str
    spec: dict[str, Any]
    crd_error: str  # substring of the schema or CEL message
    operator_error: str  # substring of spec.py's SpecError

    def body(self) -> dict[str, Any]:
        body = minimal_llmservice(**copy.deepcopy(self.spec))
        # A null field is dropped, as the API server prunes nulls of non-nullable fields.
        body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
        return body


BAD_SPECS = [
    BadSpec("quantization-enum", {"quantization": "int3"},
            "'int3' is not one of ['none', 'gptq', 'awq', 'fp8', 'compressed-tensors', 'modelopt']",
            "spec.quantization must be one of none, gptq, awq, fp8, compressed-tensors, modelopt; got 'int3'"),
    BadSpec("uri-scheme", {"model": {"uri": "ftp://host/model"}},
            "does not match", "spec.model.uri must start with s3://, hf://, pvc:// or /"),
    BadSpec("model-missing", {"model": None}, "'model' is a required property",
            "spec.model is required"),
    BadSpec("negative-replicas", {"replicas": -1}, "-1 is less than the minimum of 0",
            "spec.replicas must be at least 0"),
    BadSpec("block-size", {"engine": {"blockSize": 12}}, "12 is not one of [8, 16, 32, 64, 128]",
            "spec.engine.blockSize must be one of 8, 16, 32, 64, 128; got 12"),
    BadSpec("kv-cache-dtype", {"engine": {"kvCacheDtype": "int8"}},
            "'int8' is not one of ['auto', 'fp8', 'fp8_e4m3']",
            "spec.engine.kvCacheDtype must be one of auto, fp8, fp8_e4m3; got 'int8'"),
    BadSpec("negative-admission-headroom", {"engine": {"admissionHeadroom": -1}},
            "-1 is less than the minimum of 0", "spec.engine.admissionHeadroom must be at least 0"),
    BadSpec("scheduling-policy", {"engine": {"schedulingPolicy": "lifo"}},
            "'lifo' is not one of ['fcfs', 'priority']",
            "spec.engine.schedulingPolicy must be one of fcfs, priority; got 'lifo'"),
    BadSpec("gpu-memory-utilization", {"engine": {"gpuMemoryUtilization": 1.5}},
            "1.5 is greater than the maximum of 1",
            "spec.engine.gpuMemoryUtilization must be in (0, 1]; got 1.5"),
    BadSpec("zero-gpu-memory-utilization", {"engine": {"gpuMemoryUtilization": 0}},
            "less than or equal to the minimum of 0",
            "spec.engine.gpuMemoryUtilization must be in (0, 1]; got 0"),
    BadSpec("min-replicas-zero",
            {"autoscaling": {"minReplicas": 0, "maxReplicas": 2,
                             "targetTokensPerSecondPerReplica": 100}},
            "0 is less than the minimum of 1", "spec.autoscaling.minReplicas must be at least 1"),
    BadSpec("autoscaling-target-missing", {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
            "'targetTokensPerSecondPerReplica' is a required property",
            "spec.autoscaling.targetTokensPerSecondPerReplica is required"),
    BadSpec("memory-quantity", {"resources": {"memory": "lots"}}, "does not match",
            "spec.resources.memory must be a Kubernetes quantity"),
    BadSpec("toleration-effect", {"resources": {"tolerations": [{"key": "a", "effect": "Never"}]}},
            "'Never' is not one of", "spec.resources.tolerations[0].effect must be one of"),
    # CEL rules (x-kubernetes-validations)
    BadSpec("min-above-max",
            {"autoscaling": {"minReplicas": 5, "maxReplicas": 2,
                             "targetTokensPerSecondPerReplica": 100}},
            "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
            "spec.autoscaling.minReplicas (5) must be <= spec.autoscaling.maxReplicas (2)"),
    BadSpec("s3-without-s3-uri",
            {"model": {"uri": "hf://org/model"}, "s3": {"endpoint": "http://minio:9000"}},
            "s3 is allowed only with an s3:// model.uri",
            "spec.s3 is allowed only with an s3:// model.uri"),
    BadSpec("revision-of-an-s3-model", {"model": {"uri": "s3://models/model", "revision": "v1"}},
            "model.revision is for an hf:// model.uri without its own @REVISION",
            "spec.model.revision is for an hf:// model.uri without its own @REVISION"),
    BadSpec("revision-twice", {"model": {"uri": "hf://org/model@v1", "revision": "v2"}},
            "model.revision is for an hf:// model.uri without its own @REVISION",
            "spec.model.revision is for an hf:// model.uri without its own @REVISION"),
    # kvfleet pull's --include / --exclude globs
    BadSpec("include-not-a-list", {"model": {"uri": "hf://org/model", "include": "*.safetensors"}},
            "'*.safetensors' is not of type 'array'", "spec.model.include must be a list"),
    BadSpec("include-empty-glob", {"model": {"uri": "hf://org/model", "include": ["*.json", ""]}},
            "'' should be non-empty", "spec.model.include[1] must be a non-empty string"),
    BadSpec("exclude-glob-like-an-option", {"model": {"uri": "s3://models/model", "exclude": ["--all"]}},
            "does not match", "spec.model.exclude[0] must not start with '-'"),
    BadSpec("include-of-a-pvc-model", {"model": {"uri": "pvc://weights/model", "include": ["*.json"]}},
            "model.include and model.exclude are for an s3:// or hf:// model.uri",
            "spec.model.include is for an s3:// or hf:// model.uri"),
    BadSpec("exclude-of-a-model-in-the-image", {"model": {"uri": "/opt/model", "exclude": ["original/*"]}},
            "model.include and model.exclude are for an s3:// or hf:// model.uri",
            "spec.model.exclude is for an s3:// or hf:// model.uri"),
    BadSpec("hf-endpoint-not-a-url",
            {"model": {"uri": "hf://org/model"}, "hf": {"endpoint": "hf-mirror.internal"}},
            "does not match", "spec.hf.endpoint must be an http:// or https:// URL"),
    BadSpec("hf-without-hf-uri",
            {"model": {"uri": "s3://models/model"}, "hf": {"tokenSecret": "hf-token"}},
            "hf is allowed only with an hf:// model.uri",
            "spec.hf is allowed only with an hf:// model.uri"),
    BadSpec("tensor-parallel-above-gpus",
            {"engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}},
            "engine.tensorParallelSize must be <= resources.gpus",
            "spec.engine.tensorParallelSize (4) must be <= spec.resources.gpus (2)"),
    BadSpec("tensor-parallel-default-gpus", {"engine": {"tensorParallelSize": 2}},
            "engine.tensorParallelSize must be <= resources.gpus",
            "spec.engine.tensorParallelSize (2) must be <= spec.resources.gpus (1)"),
    BadSpec("cache-both", {"cache": {"size": "10Gi", "persistentVolumeClaim": "models"}},
            "cache takes either size or persistentVolumeClaim, not both",
            "spec.cache takes either size (an emptyDir) or persistentVolumeClaim, not both"),
    # LoRA adapters
    BadSpec("adapter-name", {"adapters": [{"name": "SQL_Adapter", "uri": "s3://models/sql"}]},
            "does not match", "spec.adapters[0].name must be a DNS-1123 label"),
    BadSpec("adapter-uri-scheme", {"adapters": [{"name": "sql", "uri": "ftp://host/sql"}]},
            "does not match", "spec.adapters[0].uri must start with s3://, hf://, pvc:// or /"),
    BadSpec("adapter-uri-missing", {"adapters": [{"name": "sql"}]},
            "'uri' is a required property", "spec.adapters[0].uri is required"),
    BadSpec("adapter-names-unique",
            {"adapters": [{"name": "sql", "uri": "s3://models/sql"},
                          {"name": "sql", "uri": "s3://models/sql-v2"}]},
            "adapters[].name must be unique",
            "spec.adapters[1].name 'sql' is used by another adapter; names must be unique"),
    BadSpec("adapter-named-like-the-model",
            {"model": {"uri": "s3://models/llama", "name": "llama"},
             "adapters": [{"name": "llama", "uri": "s3://models/llama-sql"}]},
            "adapters[].name must differ from model.name",
            "spec.adapters[0].name must differ from the served model name 'llama'"),
    BadSpec("lora-knobs-without-adapters", {"engine": {"maxLoras": 2}},
            "engine.maxLoras, maxLoraRank and maxCpuLoras are allowed only with adapters",
            "spec.engine.maxLoras: allowed only with spec.adapters"),
    BadSpec("max-cpu-loras-below-max-loras",
            {"adapters": [{"name": "sql", "uri": "s3://models/sql"}],
             "engine": {"maxLoras": 4, "maxCpuLoras": 2}},
            "engine.maxCpuLoras must be >= engine.maxLoras",
            "spec.engine.maxCpuLoras (2) must be >= spec.engine.maxLoras (4)"),
    BadSpec("max-lora-rank-zero",
            {"adapters": [{"name": "sql", "uri": "s3://models/sql"}], "engine": {"maxLoraRank": 0}},
            "0 is less than the minimum of 1", "spec.engine.maxLoraRank must be at least 1"),
]
