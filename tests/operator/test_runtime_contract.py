"""The command lines the Deployment runs parse with the runtime's own `kvfleet` parser.

The operator drives the runtime only through `kvfleet serve` and `kvfleet pull`;
this pins that contract from both sides.
"""

from __future__ import annotations

import pytest
from kvfleet_operator.resources import (
    adapter_path,
    build_deployment,
    max_loras,
    pull_command,
    pull_source,
    serve_command,
)
from kvfleet_operator.spec import parse_spec
from kvfleet_runtime.cli import build_parser
from operator_harness import example_llmservices, minimal_llmservice

PARSER = build_parser()
FULL = minimal_llmservice(
    model={"uri": "s3://bucket/qwen", "name": "qwen"},
    s3={"endpoint": "http://s3:8333", "region": "eu-1", "credentialsSecret": "c", "insecure": True},
    quantization="gptq",
    engine={"blockSize": 32, "maxNumSeqs": 9, "maxNumBatchedTokens": 1024, "maxModelLen": 512,
            "gpuMemoryUtilization": 0.75, "enablePrefixCaching": False, "tensorParallelSize": 2,
            "kvCacheDtype": "fp8_e4m3", "admissionHeadroom": 256},
    resources={"gpus": 2})
LORA = minimal_llmservice(
    model={"uri": "s3://bucket/llama", "name": "llama"},
    s3={"endpoint": "http://s3:8333", "region": "eu-1", "insecure": True},
    adapters=[{"name": "sql", "uri": "s3://bucket/llama-sql"},
              {"name": "chat-de", "uri": "/opt/adapters/chat-de"}],
    engine={"maxLoraRank": 32, "maxCpuLoras": 4, "extraArgs": ["--log-level", "debug"]})


@pytest.mark.parametrize("body", example_llmservices() + [FULL, LORA],
                         ids=lambda b: f"{b['metadata']['name']}-{len(b['spec'].get('adapters', []))}")
def test_serve_command_parses_to_the_spec(body):
    spec = parse_spec(body)
    args = PARSER.parse_args(serve_command(spec)[1:])
    engine = spec.engine
    assert args.command == "serve"
    assert (args.host, args.port, args.served_model_name) == ("0.0.0.0", 8000, [spec.model.name])
    # The runtime leaves flags that were not given off the namespace (its defaults apply).
    assert (args.block_size, args.max_num_seqs, args.max_num_batched_tokens) == \
        (engine.block_size, engine.max_num_seqs, engine.max_num_batched_tokens)
    assert getattr(args, "max_model_len", None) == engine.max_model_len
    assert args.gpu_memory_utilization == pytest.approx(engine.gpu_memory_utilization)
    assert args.enable_prefix_caching is engine.enable_prefix_caching
    assert args.tensor_parallel_size == engine.tensor_parallel_size
    assert getattr(args, "kv_cache_dtype", "auto") == engine.kv_cache_dtype
    assert getattr(args, "admission_headroom", 0) == engine.admission_headroom
    assert getattr(args, "quantization", "none") == spec.quantization
    assert getattr(args, "enable_lora", False) is bool(spec.adapters)
    assert [(m.name, m.path) for m in args.lora_modules or []] == \
        [(a.name, adapter_path(spec, a)) for a in spec.adapters]
    if spec.adapters:
        assert (args.max_loras, getattr(args, "max_lora_rank", 16), getattr(args, "max_cpu_loras", None)) == \
            (max_loras(spec), spec.engine.max_lora_rank or 16, spec.engine.max_cpu_loras)


def test_lora_flags_parse_to_the_spec_with_extra_args_after_them():
    args = PARSER.parse_args(serve_command(parse_spec(LORA))[1:])
    assert [(m.name, m.path) for m in args.lora_modules] == [
        ("sql", "/adapters/sql"), ("chat-de", "/opt/adapters/chat-de")]
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 2, 32, 4)
    assert args.log_level == "debug"


@pytest.mark.parametrize("body", [FULL, LORA], ids=["full", "lora"])
def test_every_pull_command_parses_to_the_spec(body):
    spec = parse_spec(body)
    pulls = [c["command"] for c in build_deployment(spec)["spec"]["template"]["spec"]["initContainers"]]
    expected = [(pull_source(spec), "/models")] + [
        (a.uri, adapter_path(spec, a)) for a in spec.adapters if a.scheme == "s3"]
    parsed = [PARSER.parse_args(command[1:]) for command in pulls]
    assert [(args.command, args.source, args.dest) for args in parsed] == \
        [("pull", source, dest) for source, dest in expected]
    assert {(args.region, args.verify_ssl) for args in parsed} == {("eu-1", False)}
    assert pull_command(spec, "s3://b/p", "/x")[:4] == ["kvfleet", "pull", "s3://b/p", "/x"]
