"""SageMaker's routes, as vLLM serves them: /ping (GET and POST) answers as /health, and
/invocations runs a body on the API its kind names, answering what that API's own route
answers (a real `kvfleet serve`; a reranker's server for the classifier's case)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.server import ServerProcess, running_server
from support.tiny_models import make_tiny_model

NAME = "tiny"
GREEDY = {"model": NAME, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "256") as s:
        yield s


def _same(server: ServerProcess, route: str, body: dict, keys: list[str]) -> dict:
    """/invocations' answer to body, checked against `route`'s own on the fields `keys`."""
    via = httpx.post(server.base_url + "/invocations", json=body, timeout=60)
    direct = httpx.post(server.base_url + route, json=body, timeout=60)
    assert via.status_code == direct.status_code == 200, (via.text, direct.text)
    a, b = via.json(), direct.json()
    for key in keys:
        assert a[key] == b[key], key
    return a


def test_ping_answers_as_health(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/ping").status_code == 200
    assert httpx.post(server.base_url + "/ping").status_code == 200


def test_invocations_run_each_kind_on_its_api(server: ServerProcess) -> None:
    chat = _same(server, "/v1/chat/completions",
                 {**GREEDY, "messages": [{"role": "user", "content": "hi"}]}, ["usage"])
    assert chat["object"] == "chat.completion"
    completion = _same(server, "/v1/completions", {**GREEDY, "prompt": "Once upon"},
                       ["usage", "choices"])
    assert completion["object"] == "text_completion"
    embedding = _same(server, "/v1/embeddings", {"model": NAME, "input": ["a", "b"]},
                      ["data", "usage"])
    assert len(embedding["data"]) == 2
    _same(server, "/score", {"model": NAME, "text_1": "a", "text_2": ["b", "c"]}, ["data"])
    rerank = _same(server, "/rerank", {"model": NAME, "query": "a", "documents": ["b", "c"]},
                   ["results"])
    assert len(rerank["results"]) == 2


def test_a_streamed_invocation_streams(server: ServerProcess) -> None:
    with httpx.stream("POST", server.base_url + "/invocations", timeout=60,
                      json={**GREEDY, "prompt": "Once upon", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


@pytest.mark.parametrize("body, param", [
    ({"hello": 1}, None),                                   # no kind
    ({"prompt": "hi", "n": 0}, "n"),                         # its API's own check
    ({"messages": "not a list"}, "messages"),                # its model's validation
])
def test_bad_invocations_are_400s_naming_what(server: ServerProcess, body, param) -> None:
    r = httpx.post(server.base_url + "/invocations", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    if param is None:
        assert "messages" in error["message"] and "text_1" in error["message"]
    not_json = httpx.post(server.base_url + "/invocations", content=b"{", timeout=60)
    assert not_json.status_code == 400


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Iterator[ServerProcess]:
    path = make_tiny_model("qwen3", tmp_path_factory.mktemp("cls"), initializer_range=0.2)
    with running_server(path, "--served-model-name", NAME, "--max-model-len", "256",
                        "--runner", "pooling", "--hf-overrides",
                        '{"architectures": ["Qwen3ForSequenceClassification"], '
                        '"classifier_from_token": ["no", "yes"]}') as s:
        yield s


def test_a_classifiers_input_is_classified(classifier: ServerProcess) -> None:
    out = _same(classifier, "/classify", {"model": NAME, "input": ["a", "b"]}, ["data"])
    assert out["data"][0]["num_classes"] == 2
