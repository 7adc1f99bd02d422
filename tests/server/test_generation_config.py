"""--generation-config: a model's generation_config.json sets the sampling knobs requests leave
unset (vLLM's `auto`), on a real server."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvfleet_runtime.generation_config import generation_defaults, load_sampling_defaults
from kvfleet_runtime.llm import LLM
from kvfleet_runtime.sampling_params import SamplingParams
from support.server import ServerProcess, running_server

# greedy and 5 tokens unless a request says otherwise; top_k 50 and repetition_penalty 1.0
# are transformers' own defaults, which set nothing (as in vLLM)
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 5, "top_k": 50,
                     "repetition_penalty": 1.0, "eos_token_id": 2, "do_sample": True}


def test_only_the_knobs_that_differ_from_transformers_defaults_are_taken() -> None:
    assert generation_defaults(GENERATION_CONFIG) == {"temperature": 0.0, "max_tokens": 5}
    assert generation_defaults({"top_p": 0.9, "min_p": 0.05, "top_k": 20}) == {
        "top_p": 0.9, "min_p": 0.05, "top_k": 20}


@pytest.fixture(scope="module")
def model(tiny_llama: Path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


def test_auto_reads_the_models_folder_and_vllm_reads_nothing(model: Path, tmp_path: Path) -> None:
    assert load_sampling_defaults("auto", str(model)) == {"temperature": 0.0, "max_tokens": 5}
    assert load_sampling_defaults("vllm", str(model)) == {}
    assert load_sampling_defaults("auto", str(tmp_path)) == {}      # no file: the API's
    assert load_sampling_defaults(str(model), "elsewhere.gguf") == {
        "temperature": 0.0, "max_tokens": 5}


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerProcess]:
    with running_server(model) as server:
        yield server


def chat(server: ServerProcess, **fields) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Tell me a story"}], "ignore_eos": True,
        **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_unset_knobs_take_the_models_defaults(server: ServerProcess) -> None:
    body = chat(server, n=3)
    # max_new_tokens 5, and greedy: three samples alike, as a temperature-0 request's
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    assert body["usage"]["completion_tokens"] == 15
    texts = {c["message"]["content"] for c in body["choices"]}
    assert texts == {chat(server, temperature=0)["choices"][0]["message"]["content"]}


def test_a_requests_own_values_win(server: ServerProcess) -> None:
    body = chat(server, n=4, temperature=1.5, seed=1, max_tokens=7)
    assert body["usage"]["completion_tokens"] == 28
    assert len({c["message"]["content"] for c in body["choices"]}) > 1     # sampled


def test_the_offline_api_takes_them_without_sampling_params(model: Path) -> None:
    llm = LLM(str(model), device="cpu", max_model_len=128)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    (out,) = llm.generate("Tell me a story", None)
    assert len(out.outputs[0].token_ids) <= 5      # greedy, 5 at most (EOS may come first)
    plain = LLM.from_config(llm.engine.config, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
