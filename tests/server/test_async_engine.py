"""AsyncLLMEngine in-process on a tiny real checkpoint: cumulative streams, every way a
consumer can leave (break, cancel, abort, shutdown), and a dead step loop."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvfleet_runtime.sampling_params import SamplingParams
from kvfleet_runtime.server.api import build_app

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def _engine(model: Path, engine_process: bool = False) -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(model=str(model), max_model_len=256, device="cpu"),
                          engine_process=engine_process)


# the LLMEngine in a thread of this process, and in a process of its own (engine_process.py;
# test_engine_process.py has what only that mode does)
MODES = pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])


@pytest.fixture(scope="module", params=[False, True], ids=["thread", "process"])
def engine(tiny_llama: Path, request) -> Iterator[AsyncLLMEngine]:
    engine = _engine(tiny_llama, request.param)
    yield engine
    asyncio.run(engine.shutdown())


async def _until_idle(engine: AsyncLLMEngine, limit: float = 1.0) -> float:
    start = time.monotonic()
    while True:
        stats = engine.get_stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < limit, stats
        await asyncio.sleep(0.01)


async def test_generate_yields_cumulative_outputs_until_finished(engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = [out async for out in engine.generate("Hello there", params, request_id="cumul")]
    tokens = [out.outputs[0].token_ids for out in outs]
    assert all(a == b[:len(a)] for a, b in itertools.pairwise(tokens))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].outputs[0].finish_reason == "length" and len(tokens[-1]) == 6
    assert outs[-1].request_id == "cumul"
    assert outs[-1].prompt_token_ids == engine.tokenizer.encode("Hello there")


async def test_leaving_the_loop_aborts_and_frees_blocks(engine) -> None:
    async for out in engine.generate("Leave early", LONG):
        if len(out.outputs[0].token_ids) >= 3:
            assert engine.get_stats().kv_cache_usage > 0
            break
    assert await _until_idle(engine) < 1.0


async def test_a_cancelled_consumer_aborts_its_request(engine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("Cancel me", LONG):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _until_idle(engine) < 1.0


async def test_abort_ends_the_stream_with_finish_reason_abort(engine) -> None:
    last = None
    async for out in engine.generate("Abort me", LONG, request_id="to-abort"):
        if last is None:
            await engine.abort("to-abort")
        last = out
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 200
    assert await _until_idle(engine) < 1.0


async def test_the_engines_own_check_reaches_the_caller(engine) -> None:
    too_long = SamplingParams(max_tokens=300)
    with pytest.raises(ValueError, match="maximum context length is 256"):
        async for _ in engine.generate("x", too_long):
            pass
    # and the loop goes on
    assert engine.is_healthy
    outs = [o async for o in engine.generate("x", SamplingParams(max_tokens=2, ignore_eos=True))]
    assert outs[-1].finished


@MODES
async def test_shutdown_ends_unfinished_requests_as_aborted(tiny_llama: Path,
                                                          engine_process: bool) -> None:
    engine = _engine(tiny_llama, engine_process)
    outs = []

    async def consume() -> None:
        async for out in engine.generate("Until shutdown", LONG):
            outs.append(out)
            if len(outs) == 2:
                await engine.shutdown()

    await asyncio.wait_for(consume(), 30)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not engine.is_healthy
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("after", LONG):
            pass


async def test_a_dead_loop_fails_requests_and_health(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    app = build_app(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvfleet") as http:
        assert (await http.get("/health")).status_code == 200

        def broken_step():
            raise RuntimeError("simulated CUDA error")
        engine.engine.step = broken_step       # the fault: the next step raises
        with pytest.raises(EngineDeadError, match="simulated CUDA error"):
            async for _ in engine.generate("doomed", LONG):
                pass
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.check_health()
        health = await http.get("/health")
        assert health.status_code == 503 and "died" in health.json()["error"]["message"]
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param",
                                                                   "code"}


async def test_a_dead_engine_whose_loop_is_stuck_fails_requests_and_shuts_down(
        tiny_llama: Path, monkeypatch) -> None:
    # A tensor-parallel rank spinning on the GPU in a collective with a dead peer: the loop
    # thread never comes back from step(), while the worker supervisor has marked it dead.
    import kvfleet_runtime.engine.async_engine as async_engine
    engine = _engine(tiny_llama)
    stuck, release = threading.Event(), threading.Event()

    def stuck_step():
        stuck.set()
        release.wait(60)
        raise RuntimeError("released")
    engine.engine.step = stuck_step
    monkeypatch.setattr(async_engine, "DEAD_JOIN_S", 0.5)
    try:
        consume = asyncio.ensure_future(_drain(engine.generate("doomed", LONG)))
        assert await asyncio.get_running_loop().run_in_executor(None, stuck.wait, 10)
        engine.fail_requests_if_dead()          # healthy yet: nothing happens
        await asyncio.sleep(0.2)
        assert not consume.done() and engine.is_healthy
        engine.engine.death_reason = lambda: "tensor-parallel rank 1 exited with code -9"
        assert not engine.is_healthy
        engine.fail_requests_if_dead()
        with pytest.raises(EngineDeadError, match="rank 1 exited"):
            await asyncio.wait_for(consume, 5)
        start = time.monotonic()
        await asyncio.wait_for(engine.shutdown(), 10)   # does not wait for the stuck loop
        assert time.monotonic() - start < 5
    finally:
        release.set()


async def _drain(stream) -> None:
    async for _ in stream:
        pass
