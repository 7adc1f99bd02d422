"""The command lines the Deployment runs parse with the runtime's own `kvfleet` parser.

The operator drives the runtime only through `kvfleet serve` and `kvfleet pull`;
this pins that contract from both sides.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

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
from kvfleet_runtime.server.cli import engine_config_from_args
from operator_harness import example_llmservices, minimal_llmservice

PARSER = build_parser()
FULL = minimal_llmservice(
    model={"uri": "s3://bucket/qwen", "name": "qwen"},
    s3={"endpoint": "http://s3:8333", "region": "eu-1", "credentialsSecret": "c", "insecure": True},
    quantization="gptq",
    engine={"blockSize": 32, "maxNumSeqs": 9, "maxNumBatchedTokens": 1024, "maxModelLen": 512,
            "gpuMemoryUtilization": 0.75, "enablePrefixCaching": False, "tensorParallelSize": 2,
            "kvCacheDtype": "fp8_e4m3", "admissionHeadroom": 256, "schedulingPolicy": "priority"},
    resources={"gpus": 2})
LORA = minimal_llmservice(
    model={"uri": "s3://bucket/llama", "name": "llama", "include": ["*.safetensors", "*.json"],
           "exclude": ["original/*", "*.pth"]},
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
    assert getattr(args, "scheduling_policy", "fcfs") == (engine.scheduling_policy or "fcfs")
    assert getattr(args, "quantization", "none") == spec.quantization
    assert getattr(args, "enable_lora", False) is bool(spec.adapters)
    assert [(m.name, m.path) for m in args.lora_modules or []] == \
        [(a.name, adapter_path(spec, a)) for a in spec.adapters]
    if spec.adapters:
        assert (args.max_loras, getattr(args, "max_lora_rank", 16), getattr(args, "max_cpu_loras", None)) == \
            (max_loras(spec), spec.engine.max_lora_rank or 16, spec.engine.max_cpu_loras)
    # the runtime's own EngineConfig takes them (e.g. the reranker's --hf-overrides JSON)
    config = engine_config_from_args(args, model="/models/x")
    assert config.scheduling_policy == (engine.scheduling_policy or "fcfs")
    if "--hf-overrides" in spec.engine.extra_args:
        assert config.hf_overrides["classifier_from_token"] == ["no", "yes"]
        assert config.runner == "pooling"


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
    # the model's globs reach its pull only; an adapter's pull takes every file
    assert [(tuple(args.include), tuple(args.exclude)) for args in parsed] == \
        [(spec.model.include, spec.model.exclude)] + [((), ())] * (len(parsed) - 1)
    assert pull_command(spec, "s3://b/p", "/x")[:4] == ["kvfleet", "pull", "s3://b/p", "/x"]


def test_init_containers_pull_a_gated_hf_model_and_adapter_with_the_secrets_token(tmp_path):
    """The pod's pulls from the Hub (its stand-in, tests/support/hub.py), each init container's env
    resolved as the kubelet would: the runtime image's ENV (HF_HUB_OFFLINE=1, see the Dockerfile)
    under the container's own, HF_TOKEN from the Secret spec.hf.tokenSecret names."""
    import subprocess
    import sys

    from support.hub import HubServer

    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    image_env = dict(re.findall(r"\b(HF_HUB_OFFLINE)=(\S+)", dockerfile))
    assert image_env == {"HF_HUB_OFFLINE": "1"}, "the runtime image's offline setting moved: update this test"
    hub = HubServer()
    try:
        model = hub.create_repo("meta-llama/Tiny", {"config.json": b"{}", "model.safetensors": b"\0" * 4096,
                                                    "original/consolidated.00.pth": b"\1" * 4096},
                                gated=True, tokens=("hf_granted",))
        hub.push("meta-llama/Tiny", {"config.json": b'{"moved": true}'})   # main moves on; the spec pins v1
        hub.tag("meta-llama/Tiny", "v1", model)
        hub.create_repo("org/tiny-sql", {"adapter_config.json": b"{}", "adapter_model.safetensors": b"\2" * 512},
                        private=True, tokens=("hf_granted",))
        secrets = {"hf-token": {"HF_TOKEN": "hf_granted"}}
        spec = parse_spec(minimal_llmservice(model={"uri": "hf://meta-llama/Tiny", "revision": "v1"},
                                             adapters=[{"name": "sql", "uri": "hf://org/tiny-sql"}],
                                             hf={"tokenSecret": "hf-token", "endpoint": hub.url}))
        for init in build_deployment(spec)["spec"]["template"]["spec"]["initContainers"]:
            # the Hub's address comes from spec.hf.endpoint alone
            env = {**{k: v for k, v in hub.env().items() if k != "HF_ENDPOINT"}, **image_env}
            for e in init["env"]:
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                env[e["name"]] = secrets[ref["name"]][ref["key"]] if ref else e["value"]
            env["HOME"] = str(tmp_path)
            command = init["command"]
            pulled = subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", "pull", command[2],
                                     str(tmp_path) + command[3], *command[4:]],
                                    env=env, capture_output=True, text=True, timeout=300)
            assert pulled.returncode == 0, f"{init['name']}: {pulled.stderr}"
    finally:
        hub.stop()
    assert {p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".kvfleet")} == \
        {"config.json", "model.safetensors"}
    assert (tmp_path / "models" / "config.json").read_bytes() == b"{}"
    assert {p.name for p in (tmp_path / "adapters" / "sql").iterdir() if not p.name.startswith(".kvfleet")} == \
        {"adapter_config.json", "adapter_model.safetensors"}


def test_the_model_pull_takes_exactly_the_files_the_spec_globs_choose(tmp_path):
    """The init container's command run against the Hub's stand-in: include replaces the default
    choice (original/ comes along), exclude narrows it (no *.pth)."""
    import subprocess
    import sys

    from support.hub import HubServer

    hub = HubServer()
    try:
        hub.create_repo("meta-llama/Tiny", {"config.json": b"{}", "model.safetensors": b"\0" * 4096,
                                            "README.md": b"# tiny",
                                            "original/params.json": b"{}",
                                            "original/consolidated.00.pth": b"\1" * 4096})
        spec = parse_spec(minimal_llmservice(model={
            "uri": "hf://meta-llama/Tiny", "include": ["*.json", "*.safetensors", "original/*"],
            "exclude": ["*.pth"]}, hf={"endpoint": hub.url}))
        (init,) = build_deployment(spec)["spec"]["template"]["spec"]["initContainers"]
        command = init["command"]
        env = {**hub.env(), **{e["name"]: e["value"] for e in init["env"]}, "HOME": str(tmp_path)}
        pulled = subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", "pull", command[2],
                                 str(tmp_path) + command[3], *command[4:]],
                                env=env, capture_output=True, text=True, timeout=300)
        assert pulled.returncode == 0, pulled.stderr
    finally:
        hub.stop()
    models = tmp_path / "models"
    assert sorted(str(p.relative_to(models)) for p in models.rglob("*")
                  if p.is_file() and not p.relative_to(models).parts[0].startswith(".kvfleet")) == \
        ["config.json", "model.safetensors", "original/params.json"]


@pytest.mark.slow
def test_init_containers_pull_peft_adapters_that_kvfleet_serve_then_lists(tmp_path):
    """The pod on one machine: the Deployment's init commands pull the model and two PEFT
    adapter folders (adapter_config.json + adapter_model.safetensors, no config.json) from
    S3, then its serve command, paths moved under tmp_path, serves all three names."""
    import subprocess
    import sys

    from support.lora import make_lora_adapter
    from support.s3 import start_seaweedfs
    from support.server import running_server
    from support.tiny_models import make_tiny_model

    checkpoint = make_tiny_model("llama", tmp_path / "ckpt")
    for name, seed in (("sql", 0), ("chat-de", 1)):
        make_lora_adapter(checkpoint, tmp_path / "peft" / name, rank=8, seed=seed)
    s3 = start_seaweedfs(tmp_path / "s3")
    try:
        spec = parse_spec(minimal_llmservice(
            model={"uri": "s3://models/llama", "name": "llama"}, s3={"endpoint": s3.endpoint},
            adapters=[{"name": "sql", "uri": "s3://models/llama-adapters/sql"},
                      {"name": "chat-de", "uri": "s3://models/llama-adapters/chat-de"}]))
        s3.client().create_bucket(Bucket="models")
        s3.upload_dir(checkpoint, "models", "llama")
        for name in ("sql", "chat-de"):
            s3.upload_dir(tmp_path / "peft" / name, "models", f"llama-adapters/{name}")

        def local(path: str) -> str:  # the pod's volumes (/models, /adapters), here
            return str(tmp_path) + path

        pod = build_deployment(spec)["spec"]["template"]["spec"]
        for init in pod["initContainers"]:
            command = init["command"]
            pulled = subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", "pull", command[2],
                                     local(command[3]), *command[4:]],
                                    env=s3.env(), capture_output=True, text=True, timeout=300)
            assert pulled.returncode == 0, f"{init['name']}: {pulled.stderr}"
    finally:
        s3.stop()
    for name in ("sql", "chat-de"):
        files = {p.name for p in (tmp_path / "adapters" / name).iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files
        assert "config.json" not in files
    serve = pod["containers"][0]["command"]
    assert serve[2] == "/models" and serve[3:7] == ["--host", "0.0.0.0", "--port", "8000"]
    # running_server binds 127.0.0.1 on a free port itself
    flags = [arg.replace("=/adapters/", f"={tmp_path}/adapters/") for arg in serve[7:]]
    with running_server(tmp_path / "models", *flags, "--num-gpu-blocks", "64",
                        "--max-model-len", "256") as server:
        status, body = server.get("/v1/models")
        assert status == 200, body + server.log()
        assert [m["id"] for m in json.loads(body)["data"]] == ["llama", "sql", "chat-de"]
