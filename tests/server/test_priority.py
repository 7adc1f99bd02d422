"""vLLM's request `priority` through a real `kvfleet serve --scheduling-policy priority` (one
running request at a time): queued requests run lower priority first, on every API that takes
it; a server on fcfs (the default) refuses any priority but 0 with a 400 naming it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.server import ServerProcess, running_server

NAME = "tiny"


@pytest.fixture(scope="module", params=[(), ("--async-scheduling",), ("--engine-process",)],
                ids=["sync", "async", "engine-process"])
def server(tiny_llama: Path, request) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "1024",
                        "--scheduling-policy", "priority", "--max-num-seqs", "1",
                        *request.param) as s:
        yield s


def _waiting(server: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 30
    while server.metric("kvfleet_num_requests_waiting") < count:
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.02)


def test_queued_requests_run_by_priority_then_arrival(server: ServerProcess) -> None:
    finished: list[int] = []
    lock = threading.Lock()

    def post(i: int, priority: int, path: str) -> None:
        body = ({"prompt": f"request {i}"} if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": f"request {i}"}]})
        r = httpx.post(server.base_url + path, timeout=120, json={
            **body, "model": NAME, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "priority": priority})
        assert r.status_code == 200, r.text
        with lock:
            finished.append(i)

    # a long request holds the one running slot while the others queue behind it in order
    with httpx.Client(base_url=server.base_url, timeout=120) as http, \
            http.stream("POST", "/v1/completions", json={
                "model": NAME, "prompt": "hold", "max_tokens": 1000, "ignore_eos": True,
                "stream": True, "priority": 9}) as held:
        assert held.status_code == 200
        lines = held.iter_lines()      # (held until the connection closes: leave_mid_stream)
        list(itertools.islice(lines, 2))
        threads = []
        for i, priority in enumerate([3, 1, 2, 0, 1, -4]):
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            threads.append(threading.Thread(target=post, args=(i, priority, path)))
            threads[-1].start()
            _waiting(server, i + 1)
        assert finished == []
    # the client left: the holder is aborted, and the queue runs one at a time
    for t in threads:
        t.join(120)
    assert finished == [5, 3, 1, 4, 2, 0]
    deadline = time.monotonic() + 10
    while not server.idle():
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.05)


def test_every_api_takes_a_priority(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    r = client.completions.create(model=NAME, prompt="hi", max_tokens=2,
                                  extra_body={"priority": -2, "ignore_eos": True})
    assert r.usage.completion_tokens == 2
    r = client.chat.completions.create(model=NAME, max_tokens=2, extra_body={"priority": 7},
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content is not None
    r = client.responses.create(model=NAME, input="hi", max_output_tokens=2,
                                extra_body={"priority": 1, "ignore_eos": True})
    assert r.usage.output_tokens == 2
    r = client.embeddings.create(model=NAME, input=["a", "b"], extra_body={"priority": 3})
    assert len(r.data) == 2
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.post("/score", json={"model": NAME, "text_1": "a", "text_2": ["b", "c"],
                                      "priority": 2})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        r = http.post("/rerank", json={"model": NAME, "query": "a", "documents": ["b", "c"],
                                       "priority": -1})
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2,
                                               "priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


@pytest.fixture(scope="module")
def fcfs_server(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "256") as s:
        yield s


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/score", {"text_1": "a", "text_2": "b"}),
    ("/rerank", {"query": "a", "documents": ["b"]}),
])
def test_fcfs_refuses_a_priority_naming_it(fcfs_server: ServerProcess, path, body) -> None:
    with httpx.Client(base_url=fcfs_server.base_url, timeout=60) as http:
        r = http.post(path, json={**body, "model": NAME, "priority": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "priority"
        assert "--scheduling-policy priority" in error["message"]
        assert http.post(path, json={**body, "model": NAME, "priority": 0}).status_code == 200
    assert fcfs_server.idle()
