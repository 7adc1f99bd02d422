"""spec.py: the typed LLMServiceSpec, its defaults (the same as the CRD's) and its errors."""

from __future__ import annotations

import re
from typing import Any

import pytest
from kvfleet_operator.spec import LLMServiceSpec, SpecError, parse_spec
from operator_harness import BAD_SPECS, BadSpec, load_crd, minimal_llmservice


def crd_defaults(schema: dict[str, Any], path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every `default:` in the CRD's spec schema, by field path."""
    found = {}
    for key, sub in (schema.get("properties") or {}).items():
        if "default" in sub:
            found[path + (key,)] = sub["default"]
        found.update(crd_defaults(sub, path + (key,)))
    return found


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_defaults_equal_the_crds_defaults():
    schema = load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    defaults = crd_defaults(schema["properties"]["spec"])
    assert len(defaults) >= 10
    # Every optional section present but empty, so each default has somewhere to land.
    spec = parse_spec(minimal_llmservice(
        s3={}, engine={}, resources={}, cache={},
        autoscaling={"minReplicas": 1, "maxReplicas": 1, "targetTokensPerSecondPerReplica": 1}))
    for path, default in defaults.items():
        value: Any = spec
        for part in path:
            value = getattr(value, snake(part))
        assert value == default, f"spec.{'.'.join(path)}: spec.py {value!r} != CRD {default!r}"


def test_minimal_spec_gets_defaults_and_a_served_name_from_the_uri():
    spec = parse_spec(minimal_llmservice(model={"uri": "s3://models/meta-llama/Llama-3.1-8B/"}))
    assert isinstance(spec, LLMServiceSpec)
    assert (spec.name, spec.namespace) == ("demo", "default")
    assert spec.model.name == "Llama-3.1-8B"
    assert spec.model.scheme == "s3"
    assert spec.autoscaling is None and spec.s3 is None
    assert spec.min_replicas == 1


def test_full_spec_is_read_field_by_field():
    spec = parse_spec(minimal_llmservice(
        model={"uri": "s3://b/m", "name": "m"},
        s3={"endpoint": "http://s3:8333", "region": "eu-1", "credentialsSecret": "creds",
            "insecure": True},
        quantization="gptq",
        engine={"blockSize": 32, "maxNumSeqs": 7, "maxNumBatchedTokens": 99, "maxModelLen": 512,
                "gpuMemoryUtilization": 0.5, "enablePrefixCaching": False,
                "tensorParallelSize": 2, "extraArgs": ["--x"]},
        resources={"gpus": 2, "gpuType": "H100", "nodeSelector": {"a": "b"},
                   "tolerations": [{"key": "k", "operator": "Exists"}], "cpu": 4, "memory": "8Gi"},
        replicas=3, cache={"persistentVolumeClaim": "pvc"}, image="img:1", apiKeySecret="key"))
    assert spec.s3.insecure and spec.s3.credentials_secret == "creds"
    assert spec.engine.max_model_len == 512 and spec.engine.extra_args == ("--x",)
    assert spec.resources.cpu == "4" and spec.resources.tolerations[0]["operator"] == "Exists"
    assert spec.cache.persistent_volume_claim == "pvc"
    assert spec.secret_refs() == [("spec.s3.credentialsSecret", "creds", ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")),
                                  ("spec.apiKeySecret", "key", ("KVFLEET_API_KEY",))]


def test_an_hf_model_is_named_without_its_revision():
    assert parse_spec(minimal_llmservice(model={"uri": "hf://Qwen/Qwen2.5-0.5B@v1"})).model.name == "Qwen2.5-0.5B"
    spec = parse_spec(minimal_llmservice(model={"uri": "hf://Qwen/Qwen2.5-0.5B", "revision": "main"}))
    assert (spec.model.name, spec.model.revision) == ("Qwen2.5-0.5B", "main")


def test_hf_token_secret_is_read_for_an_hf_model_or_adapter():
    spec = parse_spec(minimal_llmservice(model={"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "revision": "main"},
                                         hf={"tokenSecret": "hf-token"}, apiKeySecret="hf-token"))
    assert spec.hf.token_secret == "hf-token"
    # one Secret may serve two fields; each is checked for its own key
    assert spec.secret_refs() == [("spec.hf.tokenSecret", "hf-token", ("HF_TOKEN",)),
                                  ("spec.apiKeySecret", "hf-token", ("KVFLEET_API_KEY",))]
    adapter_only = parse_spec(minimal_llmservice(adapters=[{"name": "sql", "uri": "hf://org/llama-sql"}],
                                                 hf={"tokenSecret": "hf-token"}))
    assert adapter_only.hf.token_secret == "hf-token"
    assert parse_spec(minimal_llmservice(model={"uri": "hf://org/m"})).hf is None


def test_pull_globs_are_read_in_order_for_an_s3_or_hf_model():
    spec = parse_spec(minimal_llmservice(model={"uri": "hf://org/m", "include": ["*.safetensors", "*.json"],
                                                "exclude": ["original/*"]}))
    assert (spec.model.include, spec.model.exclude) == (("*.safetensors", "*.json"), ("original/*",))
    s3 = parse_spec(minimal_llmservice(model={"uri": "s3://b/m", "exclude": ["*.bin"]})).model
    assert (s3.include, s3.exclude) == ((), ("*.bin",))
    assert parse_spec(minimal_llmservice()).model.include == ()


@pytest.mark.parametrize("bad", BAD_SPECS, ids=lambda b: b.id)
def test_bad_specs_raise_errors_naming_the_field(bad: BadSpec):
    with pytest.raises(SpecError) as error:
        parse_spec(bad.body())
    assert bad.operator_error in str(error.value)


@pytest.mark.parametrize("body, message", [
    ({"metadata": {"name": "Bad_Name", "namespace": "d"}, "spec": {}},
     "metadata.name must be a DNS-1035 label"),
    ({"metadata": {"name": "ok", "namespace": "d"}}, "spec is required"),
    (minimal_llmservice(replicas=True), "spec.replicas must be an integer; got True"),
    (minimal_llmservice(engine={"extraArgs": [1]}), "spec.engine.extraArgs must be a list of strings"),
    (minimal_llmservice(engine={"schedulingPolicy": 1}), "spec.engine.schedulingPolicy must be a string; got 1"),
    (minimal_llmservice(model={"uri": "s3://b/m", "include": ["*.json", 7]}),
     "spec.model.include[1] must be a non-empty string (a glob such as '*.safetensors'); got 7"),
    (minimal_llmservice(model={"uri": "s3://b/m", "exclude": ["*"] * 65}),
     "spec.model.exclude holds at most 64 globs; got 65"),
])
def test_shapes_the_schema_would_stop_are_caught_too(body, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(body)


def test_adapters_are_read_in_order_with_their_lora_knobs():
    spec = parse_spec(minimal_llmservice(
        model={"uri": "hf://org/llama"}, s3={"endpoint": "http://s3:8333"},
        adapters=[{"name": "sql", "uri": "s3://adapters/sql"},
                  {"name": "chat-de", "uri": "/opt/adapters/de"}],
        engine={"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8}))
    assert [(a.name, a.uri, a.scheme) for a in spec.adapters] == [
        ("sql", "s3://adapters/sql", "s3"), ("chat-de", "/opt/adapters/de", "path")]
    assert (spec.engine.max_loras, spec.engine.max_lora_rank, spec.engine.max_cpu_loras) == (2, 64, 8)
    # an s3 block serves an s3:// adapter even when the model comes from elsewhere
    assert spec.s3.endpoint == "http://s3:8333"
    assert parse_spec(minimal_llmservice()).adapters == ()


@pytest.mark.parametrize("spec, message", [
    # the served name derived from the URI ("llama") clashes too; the CRD sees only model.name
    ({"adapters": [{"name": "llama", "uri": "s3://models/llama-sql"}]},
     "spec.adapters[0].name must differ from the served model name 'llama'"),
    ({"adapters": {"name": "sql"}}, "spec.adapters must be a list"),
    ({"adapters": ["sql"]}, "spec.adapters[0] must be an object with name and uri"),
    ({"adapters": [{"name": "a" * 51, "uri": "s3://m/a"}]}, "spec.adapters[0].name must be a DNS-1123"),
    ({"model": {"uri": "hf://org/m"}, "s3": {}, "adapters": [{"name": "a", "uri": "/opt/a"}]},
     "spec.s3 is allowed only with an s3:// model.uri or spec.adapters[].uri"),
    ({"model": {"uri": "s3://b/m"}, "hf": {"tokenSecret": "t"}, "adapters": [{"name": "a", "uri": "pvc://c/a"}]},
     "spec.hf is allowed only with an hf:// model.uri or spec.adapters[].uri"),
    ({"model": {"uri": "hf://org/m"}, "hf": {"tokenSecret": 7}}, "spec.hf.tokenSecret must be a string"),
])
def test_adapter_errors_only_the_operator_sees_name_the_field(spec, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(minimal_llmservice(**spec))
