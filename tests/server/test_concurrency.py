"""Many clients at once, clients that leave, and a full queue, against one real `kvfleet serve`
(max_num_seqs 32 + 32 queued requests = 64 in flight at most)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.server import ServerProcess, leave_mid_stream, running_server

MAX_NUM_SEQS = 32
MAX_QUEUED = 32
NAME = "tiny"


# also with async scheduling (the CUDA default): streams, disconnects and back-pressure
@pytest.fixture(scope="module", params=[(), ("--async-scheduling",)], ids=["sync", "async"])
def server(tiny_llama: Path, request) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-queued-requests", str(MAX_QUEUED), "--max-model-len", "512",
                        "--served-model-name", NAME, *request.param) as s:
        yield s


def _request(i: int, max_tokens: int = 8) -> dict:
    return {"prompt": f"Request {i}: tell me about topic number {i * 7}",
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def _seconds_until_idle(server: ServerProcess, limit: float = 5.0) -> float:
    start = time.monotonic()
    while not server.idle():
        assert time.monotonic() - start < limit, server.metrics()
        time.sleep(0.05)
    return time.monotonic() - start


def _wait_for_requests(server: ServerProcess, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (server.metric("kvfleet_num_requests_running")
           + server.metric("kvfleet_num_requests_waiting")) < count:
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.05)


async def test_64_concurrent_streams_equal_the_same_requests_alone(server: ServerProcess,
                                                                    request) -> None:
    mode = "on" if request.node.callspec.params["server"] else "off"
    assert f"async scheduling {mode}" in server.log(tail=100_000)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        alone = [http.post("/v1/completions", json=_request(i)).json()["choices"][0]["text"]
                 for i in range(64)]
    client = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key="unused",
                                max_retries=0, timeout=120)

    async def stream(i: int) -> tuple[str, str | None]:
        body = _request(i)
        chunks = await client.completions.create(
            model=NAME, prompt=body.pop("prompt"), stream=True,
            max_tokens=body.pop("max_tokens"), temperature=0.0, extra_body=body)
        parts, reason = [], None
        async for chunk in chunks:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    together = await asyncio.gather(*(stream(i) for i in range(64)))
    await client.close()
    assert [reason for _, reason in together] == ["length"] * 64
    assert [text for text, _ in together] == alone
    assert len(set(alone)) > 1      # distinct prompts, distinct answers
    assert _seconds_until_idle(server) < 1.0


def test_disconnect_mid_stream_frees_the_request_within_a_second(server: ServerProcess) -> None:
    left = leave_mid_stream(server, "/v1/completions",
                            {**_request(1, max_tokens=480), "stream": True}, lines=6)
    assert len([line for line in left.lines if line.startswith("data: ")]) >= 3
    assert left.running == 1 and left.kv_cache_usage > 0
    assert left.seconds_until_idle < 1.0


async def test_disconnect_while_waiting_for_a_whole_answer_aborts_it(server: ServerProcess) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    body = httpx.Request("POST", server.base_url + "/v1/completions",
                         json=_request(2, max_tokens=480)).read()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    await asyncio.to_thread(_wait_for_requests, server, 1)
    writer.close()
    await writer.wait_closed()
    assert await asyncio.to_thread(_seconds_until_idle, server) < 1.0


async def test_full_queue_answers_503_with_retry_after_and_disturbs_nothing(
        server: ServerProcess) -> None:
    capacity = MAX_NUM_SEQS + MAX_QUEUED
    # long enough that no stream ends before the last of them is queued (at 48 tokens the
    # first 32 could finish first on a busy machine, and the queue never filled)
    tokens = 256
    limits = httpx.Limits(max_connections=capacity + 8)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
        async def run(i: int, opened: asyncio.Event) -> tuple[int, str | None]:
            async with http.stream("POST", "/v1/completions",
                                   json={**_request(i, max_tokens=tokens), "stream": True,
                                         "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                opened.set()
                last = None
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = line
            usage = httpx.Response(200, content=last[len("data: "):]).json()["usage"]
            return usage["completion_tokens"], r.headers.get("content-type")

        opened = [asyncio.Event() for _ in range(capacity)]
        tasks = [asyncio.create_task(run(i, opened[i])) for i in range(capacity)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), 60)
        await asyncio.to_thread(_wait_for_requests, server, capacity)

        refused = await http.post("/v1/completions", json=_request(999))
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert "32 running + 32 queued" in refused.json()["error"]["message"]

        results = await asyncio.gather(*tasks)
    assert [n for n, _ in results] == [tokens] * capacity
    assert _seconds_until_idle(server) < 1.0
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.post("/v1/completions", json=_request(3)).status_code == 200
