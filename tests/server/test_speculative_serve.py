"""`kvfleet serve --speculative-config`: the official openai client gets the same greedy text as
the engine without drafts gives, streamed and not; /metrics counts the drafts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvfleet_runtime import LLM, SamplingParams
from openai import OpenAI
from support.server import ServerProcess, running_server

NAME = "spec-model"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7, 8] * 6, [40, 41, 42, 43, 44] * 4 + [40, 41], [900, 17] * 9]


@pytest.fixture(scope="module", params=[(), ("--engine-process",)], ids=["thread", "engine-process"])
def server(tiny_llama: Path, request) -> Iterator[ServerProcess]:
    # the engine process sends each step's tokens as deltas: several at once with drafts
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "512",
                        "--speculative-config", json.dumps(SPEC), *request.param) as s:
        yield s


@pytest.fixture(scope="module")
def plain_llm(tiny_llama: Path) -> LLM:
    """The engine without drafts (same process settings)."""
    return LLM(model=str(tiny_llama), max_model_len=512, async_scheduling=False)


@pytest.fixture(scope="module")
def reference(plain_llm: LLM) -> list[str]:
    """The texts the engine gives these prompts without drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [o.outputs[0].text for o in plain_llm.generate(PROMPTS, params)]


def test_greedy_completions_equal_the_engine_without_drafts(server, reference) -> None:
    client = OpenAI(base_url=server.openai_base_url, api_key="unused")
    before = server.metric("kvfleet_spec_decode_num_accepted_tokens_total")
    for prompt, want in zip(PROMPTS, reference, strict=True):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == 40
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=40,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    accepted = server.metric("kvfleet_spec_decode_num_accepted_tokens_total") - before
    drafted = server.metric("kvfleet_spec_decode_num_draft_tokens_total")
    assert 0 < accepted <= drafted
    assert server.metric("kvfleet_spec_decode_num_drafts_total") > 0


def test_logprobs_with_drafts_equal_the_engine_without(server, plain_llm) -> None:
    # requests with logprobs are drafted too: the same tokens and logprobs, streamed and not
    client = OpenAI(base_url=server.openai_base_url, api_key="unused")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    before = server.metric("kvfleet_spec_decode_num_accepted_tokens_total")
    for prompt, want in zip(PROMPTS, plain_llm.generate(PROMPTS, params), strict=True):
        want = want.outputs[0]
        kwargs = dict(model=NAME, prompt=prompt, max_tokens=30, temperature=0, logprobs=2,
                      extra_body={"ignore_eos": True})
        r = client.completions.create(**kwargs)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == want.text
        assert lp.token_logprobs == pytest.approx(
            [pos[t].logprob for pos, t in zip(want.logprobs, want.token_ids, strict=True)], abs=1e-4)
        assert [v for top in lp.top_logprobs for v in sorted(top.values())] == pytest.approx(
            [v for pos in want.logprobs
             for v in sorted(x.logprob for x in pos.values() if x.rank <= 2)], abs=1e-4)
        chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)
                  if c.choices]
        assert "".join(c.text for c in chunks) == want.text
        streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
        assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert server.metric("kvfleet_spec_decode_num_accepted_tokens_total") > before


def test_a_json_schema_with_drafts_gives_the_engines_output_without(server, plain_llm) -> None:
    # a grammar's requests are drafted too (drafts cut to what the grammar allows)
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 6}},
        "required": ["tags"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured_outputs={"json": schema, "disable_any_whitespace": True})
    client = OpenAI(base_url=server.openai_base_url, api_key="unused")
    for prompt, want in zip(PROMPTS, plain_llm.generate(PROMPTS, params), strict=True):
        r = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=80, temperature=0,
            extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
        assert r.choices[0].text == want.outputs[0].text
        assert set(json.loads(r.choices[0].text)) == {"tags"}


def test_sampled_chat_with_several_choices_and_a_seed(server) -> None:
    client = OpenAI(base_url=server.openai_base_url, api_key="unused")
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "abc abc abc abc"}],
                  max_tokens=24, temperature=0.9, top_p=0.95, n=2, seed=11)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert len(first.choices) == 2
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)
    assert 2 <= first.usage.completion_tokens <= 48
