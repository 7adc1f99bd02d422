"""Reasoning outputs (`--reasoning-parser`): the split on its own, streamed in random pieces, then
a real server whose tiny model is made (guided_choice) to think before it answers or calls; and
one whose tokenizer has the tags as tokens, where a JSON schema holds only the answer after the
thinking."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvfleet_runtime.server.cli import REASONING_PARSERS
from kvfleet_runtime.server.reasoning import ReasoningStreamer, split_reasoning
from support.server import running_server
from support.tiny_models import VOCAB, make_thinking_model

from .test_tools import ASK, HERMES_CALL, TEMPLATE, WEATHER

CASES = [
    # (parser, text, reasoning, content)
    ("deepseek_r1", "Let me think.\n</think>\n\nParis.", "Let me think.\n", "Paris."),
    ("deepseek_r1", "<think>\nHm.</think>Paris.", "\nHm.", "Paris."),
    ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", None),
    ("deepseek_r1", "</think>Just this.", None, "Just this."),
    ("qwen3", "<think>\nSome thought\n</think>\n\nThe answer.", "\nSome thought\n", "The answer."),
    ("qwen3", "No thinking here </think> at all.", None, "No thinking here </think> at all."),
    ("qwen3", "  <think>cut off", "cut off", None),
    ("qwen3", "<think></think>\n\nDirect.", None, "Direct."),
    ("qwen3", "<thin", None, "<thin"),
]


def test_the_cli_offers_every_parser():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_split(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_streamed_pieces_join_to_the_split(parser, text, reasoning, content):
    rng = random.Random(text)
    for _ in range(30):
        streamer, got_r, got_c, pos = ReasoningStreamer(parser), "", "", 0
        r, c = streamer.feed("")             # the role chunk's empty first delta
        got_r, got_c = got_r + r, got_c + c
        while pos < len(text):
            step = rng.randint(1, 5)
            r, c = streamer.feed(text[pos:pos + step])
            got_r, got_c = got_r + r, got_c + c
            pos += step
        r, c = streamer.finish()
        assert (got_r + r or None, got_c + c or None) == (reasoning, content)


# ---- a real server: qwen3's parser, and Hermes tool calls after the thinking ----

@pytest.fixture(scope="module")
def client(tiny_llama: Path, tmp_path_factory) -> Iterator[openai.OpenAI]:
    template = tmp_path_factory.mktemp("reasoning") / "hermes.jinja"
    template.write_text(TEMPLATE)
    with running_server(tiny_llama, "--chat-template", str(template), "--max-model-len", "1024",
                        "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--served-model-name", "tiny") as s:
        yield openai.OpenAI(base_url=s.openai_base_url, api_key="unused", max_retries=0)


def _ask(client, stream: bool, answer: str, **kwargs) -> dict:
    """The answer the client sees (reasoning, content, tool calls, finish) to a request whose
    output is forced to `answer`."""
    body = dict(model="tiny", messages=ASK, max_tokens=120, temperature=0.0,
                extra_body={"guided_choice": [answer], **kwargs.pop("extra_body", {})}, **kwargs)
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        message = choice.message.model_dump()
        return {"reasoning": message.get("reasoning"), "content": message["content"],
                "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                          for c in message["tool_calls"] or []],
                "finish": choice.finish_reason}
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        choice = chunk.choices[0]
        delta = choice.delta.model_dump()
        assert delta.get("reasoning") == delta.get("reasoning_content")
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))],
            "finish": finish}


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_answering(client, stream):
    got = _ask(client, stream, "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny.")
    assert got == {"reasoning": "\nThe user asks about Paris.\n", "content": "It is sunny.",
                   "calls": [], "finish": "stop"}


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_calling_a_tool(client, stream):
    got = _ask(client, stream, "<think>I should look it up.</think>\n" + HERMES_CALL,
               tools=[WEATHER])
    assert got == {"reasoning": "I should look it up.", "content": None,
                   "calls": [("get_weather", {"city": "Paris", "unit": "C"})],
                   "finish": "tool_calls"}


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_it(client, stream):
    got = _ask(client, stream, "<think>secret</think>Visible.",
               extra_body={"include_reasoning": False})
    assert got == {"reasoning": None, "content": "Visible.", "calls": [], "finish": "stop"}


# ---- a tokenizer with <think> / </think> as tokens: structured outputs hold only the answer ----

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
          "required": ["name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    model = make_thinking_model(tmp_path_factory.mktemp("thinking-model"))
    with running_server(model, "--max-model-len", "512", "--reasoning-parser", "deepseek_r1",
                        "--served-model-name", "thinker") as s:
        yield openai.OpenAI(base_url=s.openai_base_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_holds_the_answer_after_the_thinking(thinking_client, stream):
    # </think> pushed to the top: the thinking ends at once (a grammar over the whole output
    # would have banned the tag: the JSON would then be all "reasoning", as deepseek_r1 reads
    # an output that never closes its thinking), and the answer follows the schema
    body = dict(model="thinker", messages=[{"role": "user", "content": "Name someone."}],
                max_tokens=60, temperature=0.0, logit_bias={str(VOCAB + 1): 100},
                # (no whitespace: the tiny model would fill max_tokens with newlines)
                extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    if stream:
        reasoning, content = "", ""
        for chunk in thinking_client.chat.completions.create(stream=True, **body):
            if chunk.choices:
                delta = chunk.choices[0].delta.model_dump()
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
    else:
        message = thinking_client.chat.completions.create(**body).choices[0].message.model_dump()
        reasoning, content = message.get("reasoning") or "", message["content"]
    assert reasoning == ""
    value = json.loads(content)
    assert set(value) == {"name"} and isinstance(value["name"], str) and len(value["name"]) <= 6
