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


def test_serve_a_hub_revision_under_its_repo_id(hub: HubServer, checkpoint: Path, tmp_path: Path) -> None:
    from openai import OpenAI
    first = hub.create_repo(REPO, folder_files(checkpoint))
    hub.tag(REPO, "v1", first)
    hub.push(REPO, {"README.md": b"moved on"})      # main moves; the tag stays
    env = {**hub.env(), "KVFLEET_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
    with running_server(f"hf://{REPO}@v1", "--max-num-seqs", "2", "--num-gpu-blocks", "16",
                        env=env) as server:
        client = OpenAI(base_url=server.openai_base_url, api_key="unused")
        assert [m.id for m in client.models.list().data] == [REPO]
        out = client.completions.create(model=REPO, prompt="hello", max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.model == REPO and out.usage.completion_tokens == 4
    folder = tmp_path / "cache/hf" / REPO / "v1"
    assert not (folder / "README.md").exists()       # v1's commit, not main's
    assert out.choices[0].text == _greedy(str(checkpoint))[1]


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
    assert config.served_model_name == "tiny-llama"
    assert _greedy(uploaded) == _greedy(str(checkpoint))
