"""AsyncLLMEngine(engine_process=True) (`kvfleet serve --engine-process`): the engine in a child
process (DeltaEngine), its steps' outputs sent back as deltas. The same outputs as the engine
in a thread of this process, field for field, also when the parent merges several steps at
once; the child's death and a failed start. (Streams, aborts, rejections and shutdown:
test_async_engine.py, in both modes.)"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvfleet_runtime.engine.delta_engine import (
    SHORT_DELTA_LEN,
    DeltaEngine,
    server_detokenizes,
    text_delta,
)
from kvfleet_runtime.engine.engine import LLMEngine
from kvfleet_runtime.engine.engine_process import EngineProcessError, OutputMerger
from kvfleet_runtime.outputs import CompletionOutput, RequestOutput
from kvfleet_runtime.sampling_params import SamplingParams
from kvfleet_runtime.server.api import build_app

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
# greedy, seeded sampling with n > 1 and logprobs, a stop string, prompt logprobs, token ids,
# seeded sampling with n > 1 alone
CASES = [
    ("Hello there", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ("Tell me a story", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, logprobs=2,
                                       ignore_eos=True)),
    ("Count: 1, 2, 3", SamplingParams(temperature=0.0, max_tokens=20, stop=["e"])),
    ([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1,
                                     ignore_eos=True)),
    # n > 1 with neither: each sample's text made by the server's process
    ("Once upon a time", SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=9,
                                        ignore_eos=True)),
]


def _engine(model: Path, engine_process: bool) -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(model=str(model), max_model_len=256, device="cpu"),
                          engine_process=engine_process)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLMEngine]:
    engine = _engine(tiny_llama, True)
    yield engine
    asyncio.run(engine.shutdown())


async def _streams(engine: AsyncLLMEngine) -> list[list]:
    async def one(i: int) -> list:
        prompt, params = CASES[i]
        return [out async for out in engine.generate(prompt, params, request_id=f"case-{i}")]
    return list(await asyncio.gather(*(one(i) for i in range(len(CASES)))))


async def test_outputs_equal_the_in_process_engines(engine, tiny_llama: Path) -> None:
    in_process = _engine(tiny_llama, False)
    try:
        expected = await _streams(in_process)
    finally:
        await in_process.shutdown()
    got = await _streams(engine)
    assert engine.tokenizer.encode("Hello there") == in_process.tokenizer.encode("Hello there")
    assert engine.config.max_model_len == 256 and engine.served_model_name
    for outs, ref in zip(got, expected, strict=True):
        # how many outputs a stream yields depends on coalescing; each is cumulative
        for a, b in itertools.pairwise(outs):
            for ca, cb in zip(a.outputs, b.outputs, strict=True):
                assert cb.token_ids[:len(ca.token_ids)] == ca.token_ids
                assert cb.text.startswith(ca.text)
        final, want = outs[-1], ref[-1]
        assert final.finished and want.finished
        assert final.metrics.first_token_time is not None
        final.metrics = want.metrics = None
        # the same tokens, text and ranks; logprob values to float noise (the requests run
        # concurrently, so each engine may batch them otherwise: CPU matmuls of other shapes
        # round in the last bits)
        got_values, final = _split_logprobs(final)
        want_values, want = _split_logprobs(want)
        assert final == want
        assert got_values == pytest.approx(want_values, rel=1e-5, abs=1e-5)
    assert got[1][-1].outputs[0].logprobs and got[3][-1].prompt_logprobs


def _split_logprobs(out: RequestOutput) -> tuple[list[float], RequestOutput]:
    """Every logprob value of out (prompt's, then each completion's cumulative and per-token
    ones), and out with them all 0.0."""
    values: list[float] = []

    def zeroed(position):
        if position is None:
            return None
        values.extend(lp.logprob for lp in position.values())
        return {tok: dataclasses.replace(lp, logprob=0.0) for tok, lp in position.items()}

    prompt = None if out.prompt_logprobs is None else [zeroed(p) for p in out.prompt_logprobs]
    outputs = []
    for c in out.outputs:
        if c.cumulative_logprob is not None:
            values.append(c.cumulative_logprob)
        outputs.append(dataclasses.replace(
            c, cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
            logprobs=None if c.logprobs is None else [zeroed(p) for p in c.logprobs]))
    return values, dataclasses.replace(out, prompt_logprobs=prompt, outputs=outputs)


def _run_to_the_end(engine: LLMEngine) -> list[list]:
    """CASES through an engine, every step's outputs."""
    try:
        for i, (prompt, params) in enumerate(CASES):
            engine.add_request(f"case-{i}", prompt, params, arrival_time=100.0 + i)
        steps = []
        while engine.has_unfinished_requests():
            steps.append(engine.step())
        return steps
    finally:
        engine.shutdown()


@pytest.mark.parametrize("group", [1, 2, 5, 1000])
def test_delta_steps_merged_together_give_each_requests_latest_output(tiny_llama: Path,
                                                                      group: int) -> None:
    """The engine process's DeltaEngine against LLMEngine, step for step: its deltas, merged
    by a parent that fell behind `group` steps at once, give one output a request, equal to
    LLMEngine's own output at the last of those steps."""
    config = EngineConfig(model=str(tiny_llama), max_model_len=256, device="cpu")
    steps = _run_to_the_end(LLMEngine(config))
    delta_engine = DeltaEngine(config)
    deltas = _run_to_the_end(delta_engine)
    assert len(steps) == len(deltas) > 5
    # the requests that need no text in the engine (no stop strings, no logprobs: "Hello
    # there") come without it; the parent detokenizes them, as AsyncLLMEngine has it expect them
    assert [server_detokenizes(params) for _, params in CASES] == [True, False, False, False, True]
    full = [d for d in itertools.chain(*deltas) if len(d) != SHORT_DELTA_LEN]
    assert all(c[2] == "" for d in full if d[0] in ("case-0", "case-4") for c in d[5])
    assert any(c[2] for d in full if d[0] == "case-2" for c in d[5])
    # a running step of one completion without text here comes as a short delta (request,
    # token, time): case-0's; n > 1 (case-4), text or logprobs in this process never do
    short = {d[0] for d in itertools.chain(*deltas) if len(d) == SHORT_DELTA_LEN}
    assert short == {"case-0"}
    merger = OutputMerger(delta_engine.tokenizer)
    for i, (_, params) in enumerate(CASES):
        merger.expect(f"case-{i}", params)
    for start in range(0, len(steps), group):
        chunk = slice(start, start + group)
        expected = {}       # LLMEngine's latest output of each request in these steps
        for outs in steps[chunk]:
            expected.update((out.request_id, out) for out in outs)
        got = merger.merge(deltas[chunk])
        assert [out.request_id for out in got] == list(expected)    # once each, in first order
        for out in got:
            want = expected[out.request_id]
            # the times differ between the two engines; LLMEngine's outputs share one
            # RequestMetrics that goes on changing
            assert out.metrics.arrival_time == want.metrics.arrival_time
            assert out.metrics.first_token_time is not None
            # counted as the engine counts them (the first sample's), whatever kind of delta
            # brought the tokens
            assert out.metrics.num_generation_tokens == len(out.outputs[0].token_ids)
            assert out.metrics.last_token_time >= out.metrics.first_token_time
            assert dataclasses.replace(out, metrics=None) == dataclasses.replace(want, metrics=None)
    assert not merger._requests and not merger._expected     # every request finished: nothing kept


def test_a_text_that_does_not_grow_at_its_end_comes_through_whole() -> None:
    """Texts go as (characters kept, what follows): one cut back (a stop string removed at the
    finish) or rewritten reaches the parent as the engine had it, also merged with others."""
    texts = ["Hello", "Hello wor", "Hello worl", "Help", "Hel"]
    assert text_delta("Hello", "Hello wor") == (5, " wor")
    assert text_delta("Hello worl", "Help") == (0, "Help")
    assert text_delta("Help", "Hel") == (0, "Hel")
    deltas, sent = [], ""
    for i, text in enumerate(texts):
        finished = i == len(texts) - 1
        deltas.append([("r", finished, 0, None, ("p", [1, 2], None) if i == 0 else None,
                        [(0, *text_delta(sent, text), [5 + i], None, None,
                          "stop" if finished else None, None)], None)])
        sent = text

    def out(i: int) -> RequestOutput:
        finished = i == len(texts) - 1
        return RequestOutput("r", "p", [1, 2], [CompletionOutput(
            0, texts[i], list(range(5, 6 + i)), finish_reason="stop" if finished else None)],
            finished)

    merger = OutputMerger()
    assert merger.merge([deltas[0]]) == [out(0)]
    assert merger.merge([deltas[1]]) == [out(1)]
    assert merger.merge(deltas[2:]) == [out(4)]      # three steps merged at once


async def test_a_killed_engine_process_fails_requests_and_health(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, True)
    app = build_app(engine)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://kvfleet") as http:
            assert (await http.get("/health")).status_code == 200
            with pytest.raises(EngineDeadError, match="engine process exited"):
                killed = False
                async for _ in engine.generate("doomed", LONG):
                    if not killed:      # at its first output: far from its 200th token
                        os.kill(engine.engine.process.pid, signal.SIGKILL)
                        killed = True
            assert not engine.is_healthy
            health = await http.get("/health")
            assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
            r = await http.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503
    finally:
        await asyncio.wait_for(engine.shutdown(), 30)


def test_a_checkpoint_that_fails_to_load_is_reported(tmp_path: Path) -> None:
    with pytest.raises(EngineProcessError, match="failed to start"):
        _engine(tmp_path / "missing", True)
