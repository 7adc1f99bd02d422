"""The command lines the Deployment runs parse with the runtime's own `kvfleet` parser.

The operator drives the runtime only through `kvfleet serve` and `kvfleet pull`;
this pins that contract from both sides.
"""

from __future__ import annotations

import pytest
from kvfleet_operator.resources import pull_command, pull_source, serve_command
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


@pytest.mark.parametrize("body", example_llmservices() + [FULL], ids=lambda b: b["metadata"]["name"])
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


def test_pull_command_parses_to_the_spec():
    spec = parse_spec(FULL)
    args = PARSER.parse_args(pull_command(spec)[1:])
    assert (args.command, args.source, args.dest) == ("pull", pull_source(spec), "/models")
    assert (args.region, args.verify_ssl) == ("eu-1", False)
