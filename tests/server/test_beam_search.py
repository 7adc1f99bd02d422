"""vLLM's `use_beam_search` through a real `kvfleet serve` and the official openai client: n beams,
best first, the same as the offline LLM.beam_search on the same checkpoint, streamed or not;
what beam search cannot honour is a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from kvfleet_runtime import LLM
from kvfleet_runtime.beam_search import BeamSearchParams
from support.server import ServerProcess, running_server

NAME = "tiny"
PROMPTS = [[5, 17, 300, 4000, 12, 99, 7], list(range(40, 61))]


@pytest.fixture(scope="module", params=[(), ("--async-scheduling",), ("--engine-process",)],
                ids=["sync", "async", "engine-process"])
def server(tiny_llama: Path, request) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "256",
                        *request.param) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path):
    llm = LLM(model=str(tiny_llama), max_model_len=256)
    searches = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6,
                                                         ignore_eos=True, length_penalty=0.5))
    tokenizer = llm.get_tokenizer()
    return [[tokenizer.decode(s.tokens[len(p):]) for s in out.sequences]
            for p, out in zip(PROMPTS, searches, strict=True)]


BEAM = {"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5}


def test_completions_return_the_best_beams_first(client, offline) -> None:
    r = client.completions.create(model=NAME, prompt=PROMPTS, n=3, max_tokens=6,
                                  extra_body=BEAM)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == offline[0] + offline[1]
    assert len(set(offline[0])) == 3
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 6 * 6


def test_a_streamed_beam_search_gives_the_same_choices(client, offline, server) -> None:
    stream = client.completions.create(model=NAME, prompt=PROMPTS[1], n=3, max_tokens=6,
                                       stream=True, extra_body=BEAM)
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == offline[1] and reasons == ["length"] * 3
    assert server.idle()


def test_chat_takes_use_beam_search(client) -> None:
    r = client.chat.completions.create(model=NAME, n=2, max_tokens=5,
                                       messages=[{"role": "user", "content": "hello"}],
                                       extra_body=BEAM)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 10
    assert r.choices[0].message.content != r.choices[1].message.content


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"stop": ["x"]}, "stop"),
    ("/v1/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"n": 11}, "n"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"max_tokens": 300}, "max_tokens"),
])
def test_what_beam_search_cannot_honour_is_refused(server, path, extra, param) -> None:
    body = ({"prompt": "hi"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(server.base_url + path, timeout=60, json={
        "model": NAME, "n": 2, "max_tokens": 4, **body, **BEAM, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert server.idle()
