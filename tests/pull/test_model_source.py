"""Models named by where they live (kvfleet_runtime.model_source): `kvfleet serve ORG/NAME` (a Hub
id, as vLLM takes it), hf://ORG/NAME[@REVISION] and s3://BUCKET/PREFIX are pulled into the cache
(KVFLEET_CACHE_DIR) and served from there, under the name given; with HF_HUB_OFFLINE a cached Hub
model loads without the Hub. The Hub is tests/support/hub.py's stand-in (no internet in CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvfleet_runtime import model_source
from support.hub import HubServer, folder_files
from support.s3 import S3Server
from support.server import running_server

REPO = "kvfleet-test/tiny-llama"


def _greedy(model: str, prompt: str = "hello") -> tuple[list[int], str]:
    from kvfleet_runtime import LLM, SamplingParams
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(model=model, max_num_seqs=2, num_gpu_blocks=16)
    try:
        out = llm.generate(prompt, params)[0].outputs[0]
        return out.token_ids, out.text
    finally:
        llm.engine.shutdown()


def _generate(env: dict[str, str], model: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", "generate", "--model", model,
                           "--raw", "--max-tokens", "4", "--num-gpu-blocks", "16", "hello"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_references_name_their_source_cache_folder_and_served_name(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    assert model_source.remote_source("Qwen/Qwen2.5-0.5B") == "hf://Qwen/Qwen2.5-0.5B"
    assert model_source.remote_source("hf://gpt2@v1") == "hf://gpt2@v1"
    assert model_source.remote_source("s3://models/llama/") == "s3://models/llama/"
    for local in ("gpt2", "/abs/path", "./rel/x", "a/b/c", "model.gguf"):
        assert model_source.remote_source(local) is None, local
    # an existing folder spelled like a Hub id stays a local path
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert model_source.remote_source("org/name") is None
    assert model_source.local_folder("hf://org/name") == tmp_path / "cache/hf/org/name/main"
    assert model_source.local_folder("hf://org/name@refs/pr/1") == tmp_path / "cache/hf/org/name/refs--pr--1"
    assert model_source.local_folder("s3://b/p/q/") == tmp_path / "cache/s3/b/p/q"
    with pytest.raises(ValueError, match="not path segments"):
        model_source.local_folder("s3://b/../etc")
    assert model_source.served_name("hf://org/name@v2") == "org/name"
    assert model_source.served_name("org/name") == "org/name"
    assert model_source.served_name("s3://models/meta/llama-3/") == "llama-3"
    assert model_source.resolve("/some/local/folder") == ("/some/local/folder", None)


def test_a_hub_id_is_pulled_into_the_cache_then_loads_offline(hub: HubServer, checkpoint: Path,
                                                             tmp_path: Path) -> None:
    hub.create_repo(REPO, {**folder_files(checkpoint), "pytorch_model.bin": os.urandom(4096)})
    env = {**hub.env(), "KVFLEET_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
    first = _generate(env, REPO)
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "cache/hf" / REPO / "main"
    assert f"pulling hf://{REPO} into {folder}" in first.stderr
    assert (folder / "config.json").exists() and not (folder / "pytorch_model.bin").exists()
    assert first.stdout.strip()

    again = _generate(env, f"hf://{REPO}")      # the same cache folder: nothing fetched
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stderr and again.stdout == first.stdout

    hub.stop()      # no Hub: offline mode loads the cached pull, online mode cannot list it
    offline = _generate({**env, "HF_HUB_OFFLINE": "1"}, REPO)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == first.stdout and "pulling" not in offline.stderr
    online = _generate(env, REPO)
    assert online.returncode == 2
    assert "cannot pull model 'kvfleet-test/tiny-llama' (no such local folder; read as a Hub id)" in online.stderr
    missing = _generate({**env, "HF_HUB_OFFLINE": "1"}, "kvfleet-test/other@v3")
    assert missing.returncode == 2
    assert "is not in the cache" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr
    # what the pull put there is what the checkpoint generates
    assert _greedy(str(folder)) == _greedy(str(checkpoint))


def test_a_missing_hub_repo_is_a_clear_error(hub: HubServer, tmp_path: Path) -> None:
    env = {**hub.env(), "KVFLEET_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
    r = _generate(env, "kvfleet-test/nope")
    assert r.returncode == 2
    assert "cannot pull model 'kvfleet-test/nope' (no such local folder" in r.stderr and "not found" in r.stderr
    explicit = _generate(env, "hf://kvfleet-test/nope")
    assert explicit.returncode == 2 and "cannot pull model 'hf://kvfleet-test/nope': " in explicit.stderr
    assert "Traceback" not in r.stderr


def test_serve_a_hub_revision_under_its_repo_id_with_hub_adapters(hub: HubServer, checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    # the model at a tag, an adapter by Hub id at start (--lora-modules) and one by hf:// while
    # serving (/v1/load_lora_adapter): each answers as the same adapter read from its folder
    import httpx
    from kvfleet_runtime import LLM, LoRARequest, SamplingParams
    from openai import OpenAI
    from support.lora import make_lora_adapter
    first = hub.create_repo(REPO, folder_files(checkpoint))
    hub.tag(REPO, "v1", first)
    hub.push(REPO, {"README.md": b"moved on"})      # main moves; the tag stays
    adapters = {name: make_lora_adapter(checkpoint, tmp_path / name, rank=8, seed=seed)
                for name, seed in (("sql", 1), ("chat", 2))}
    for name, folder in adapters.items():
        hub.create_repo(f"kvfleet-test/{name}-lora", folder_files(folder))
    env = {**hub.env(), "KVFLEET_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0",
           "KVFLEET_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    with running_server(f"hf://{REPO}@v1", "--max-num-seqs", "2", "--num-gpu-blocks", "32",
                        "--enable-lora", "--max-lora-rank", "8",
                        "--lora-modules", "sql=kvfleet-test/sql-lora", env=env) as server:
        loaded = httpx.post(server.base_url + "/v1/load_lora_adapter", timeout=120,
                            json={"lora_name": "chat", "lora_path": "hf://kvfleet-test/chat-lora"})
        assert loaded.status_code == 200, loaded.text
        client = OpenAI(base_url=server.openai_base_url, api_key="unused")
        cards = client.models.list().data
        assert [m.id for m in cards] == [REPO, "sql", "chat"]
        # the roots as given, not their cache folders (vLLM's)
        assert [m.root for m in cards] == [f"hf://{REPO}@v1", "kvfleet-test/sql-lora",
                                           "hf://kvfleet-test/chat-lora"]
        texts = {}
        for model in (REPO, "sql", "chat"):
            out = client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.model == model and out.usage.completion_tokens == 4
            texts[model] = out.choices[0].text
    folder = tmp_path / "cache/hf" / REPO / "v1"
    assert not (folder / "README.md").exists()       # v1's commit, not main's
    llm = LLM(model=str(checkpoint), enable_lora=True, max_lora_rank=8, max_loras=2,
              max_num_seqs=2, num_gpu_blocks=32)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = {REPO: llm.generate("hello", params)[0].outputs[0].text}
    for i, (name, adapter) in enumerate(adapters.items()):
        want[name] = llm.generate("hello", params, lora_request=LoRARequest(name, i + 1, str(adapter))
                                  )[0].outputs[0].text
    assert texts == want and len(set(want.values())) == 3


def test_an_s3_model_is_pulled_and_named_after_its_prefix(s3: S3Server, uploaded: str, checkpoint: Path,
                                                          tmp_path: Path, monkeypatch) -> None:
    from kvfleet_runtime import EngineConfig
    for key, value in s3.env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(model=uploaded, max_num_seqs=2, num_gpu_blocks=16)
    model_source.resolve_config(config)
    assert config.model == str(tmp_path / "cache/s3/models/tiny-llama")
    assert config.model_source == uploaded
    assert config.served_model_name == "tiny-llama"
    assert _greedy(uploaded) == _greedy(str(checkpoint))


_OFFLINE_API = """
import json, sys
from kvfleet_runtime import LLM, LoRARequest, SamplingParams
llm = LLM(model=sys.argv[1], enable_lora=True, max_lora_rank=8, max_num_seqs=2, num_gpu_blocks=32)
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
lora = LoRARequest("sql", 1, sys.argv[2])
outs = [llm.generate("hello", params, lora_request=lora)[0] for _ in range(2)]
print(json.dumps({"ids": [o.outputs[0].token_ids for o in outs],
                  "temperature": llm.get_default_sampling_params().temperature,
                  "name": llm.engine.served_model_name}))
"""


def test_offline_api_pulls_the_model_and_an_adapter_by_hub_id(hub: HubServer, checkpoint: Path,
                                                             tmp_path: Path) -> None:
    import json

    from kvfleet_runtime import LLM, LoRARequest, SamplingParams
    from support.lora import make_lora_adapter
    adapter = make_lora_adapter(checkpoint, tmp_path / "adapter", rank=8, seed=3)
    model = {**folder_files(checkpoint), "generation_config.json": b'{"temperature": 0.6}'}
    hub.create_repo(REPO, model)
    hub.create_repo("kvfleet-test/sql-lora", folder_files(adapter))
    env = {**hub.env(), "KVFLEET_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
    r = subprocess.run([sys.executable, "-c", _OFFLINE_API, REPO, "hf://kvfleet-test/sql-lora"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # the model's generation_config.json read from the pulled folder; the adapter pulled once
    assert got["temperature"] == 0.6 and got["name"] == REPO
    assert r.stderr.count("pulling hf://kvfleet-test/sql-lora") == 1
    llm = LLM(model=str(checkpoint), enable_lora=True, max_lora_rank=8, max_num_seqs=2,
              num_gpu_blocks=32)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = llm.generate("hello", params, lora_request=LoRARequest("sql", 1, str(adapter)))[0]
    base = llm.generate("hello", params)[0]
    assert got["ids"] == [want.outputs[0].token_ids] * 2
    assert want.outputs[0].token_ids != base.outputs[0].token_ids     # the adapter shows
