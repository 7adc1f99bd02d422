"""Tool calling: the parsers and the streamer on their own, then a real `kvfleet serve
--enable-auto-tool-choice --tool-call-parser hermes` with a Hermes-style chat template, driven by
the official openai client (named, required and auto tool choices, streamed and not, and a
conversation that carries the calls and their results back)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvfleet_runtime.server.cli import TOOL_CALL_PARSERS
from kvfleet_runtime.server.tools import (
    PARSERS,
    ChatTool,
    OpenAIToolError,
    ToolChoice,
    ToolPlan,
    parse_hermes,
    parse_llama3_json,
    plan_tools,
)
from pydantic import TypeAdapter
from support.server import ServerProcess, running_server
from transformers import AutoTokenizer

TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these tools:
{%- for t in tools %}
{{ t.function | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


# ---- parsers and streamer, no server ----

def test_the_cli_offers_every_parser():
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Just words.", "Just words.", []),
    (HERMES_CALL, None, [("get_weather", {"city": "Paris", "unit": "C"})]),
    ("Let me look.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Rome"),
     "Let me look.", [("get_weather", {"city": "Paris", "unit": "C"}),
                      ("get_weather", {"city": "Rome", "unit": "C"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None,   # closing tag cut
     [("get_time", {"zone": "UTC"})]),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
])
def test_hermes_parser(text, content, calls):
    got_content, got_calls = parse_hermes(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in got_calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Paris is sunny.", "Paris is sunny.", []),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
     '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}', None,
     [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome", "unit": "F"})]),
    ('{"name": "get_time", "parameters": {"zone": ', '{"name": "get_time", "parameters": {"zone": ',
     []),
    ('{"no_name": 1}', '{"no_name": 1}', []),
])
def test_llama3_json_parser(text, content, calls):
    got_content, got_calls = parse_llama3_json(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls


def _plan(mode: str, parser: str | None = None, parallel: bool = True) -> ToolPlan:
    tools = [ChatTool.model_validate(WEATHER), ChatTool.model_validate(TIME)]
    choice = ({"type": "function", "function": {"name": "get_weather"}} if mode == "named"
              else mode)
    return plan_tools(tools, TypeAdapter(ToolChoice).validate_python(choice), parallel, parser)


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "Let me look.\n" + HERMES_CALL),
    ("hermes", HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Rome").replace(
        '"C"', '{"deep": [1, {"x": "}"}]}')),
    ("hermes", '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'),   # no close
    ("hermes", "No call here, only <tool text and < signs."),
    ("hermes", "<tool_call>\nbroken\n</tool_call>"),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    ("llama3_json", "  Plain words."),
])
def test_streamed_deltas_join_to_the_parsed_answer(parser, text):
    plan = _plan("auto", parser)
    want_content, want_calls = plan.parse(text)
    rng = random.Random(len(text))
    for _ in range(20):
        streamer, deltas, pos = plan.streamer(), [], 0
        while pos < len(text):
            step = rng.randint(1, 6)
            deltas += streamer.feed(text[pos:pos + step])
            pos += step
        last, called = streamer.finish()
        deltas += last
        content = "".join(d.get("content", "") for d in deltas)
        calls: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                # the first delta of a call carries its id, type and name; later ones only
                # arguments
                entry = calls.setdefault(c["index"], {"id": c.get("id"), "name": "", "args": ""})
                assert ("id" in c) == (entry["args"] == "" and entry["name"] == "")
                entry["name"] += c["function"].get("name", "")
                entry["args"] += c["function"].get("arguments", "")
        assert called == bool(want_calls)
        if want_calls:
            assert content.strip() == (want_content or "")
            assert sorted(calls) == list(range(len(calls)))
            assert [(calls[i]["name"], json.loads(calls[i]["args"])) for i in sorted(calls)] == \
                [(c.function.name, json.loads(c.function.arguments)) for c in want_calls]
            assert all(calls[i]["id"].startswith("call_") for i in calls)
        else:
            assert content == text and not calls


def test_a_hermes_calls_arguments_stream_before_the_call_ends():
    streamer = _plan("auto", "hermes").streamer()
    pieces = []
    for ch in HERMES_CALL:
        for d in streamer.feed(ch):
            pieces += [c["function"].get("arguments", "") for c in d.get("tool_calls", [])]
    # the header, then the arguments char by char, the object's brace held back to the end
    assert pieces[0] == "" and len(pieces) > 20
    assert "".join(pieces) == '{"city": "Paris", "unit": "C"}'
    last, called = streamer.finish()
    assert last == [] and called


@pytest.mark.parametrize(("tools", "choice", "parser", "param", "words"), [
    ([WEATHER], None, None, "tool_choice", '"auto" tool choice requires the server'),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice",
     "'nope', which is not among the tools"),
    (None, "required", None, "tool_choice", '"required" needs tools'),
    ([{"type": "function", "function": {"name": "bad name!"}}], "none", None,
     "tools.0.function.name", "1-64 letters"),
    ([WEATHER, WEATHER], "none", None, "tools", "distinct function names"),
])
def test_bad_tool_requests_name_the_field(tools, choice, parser, param, words):
    parsed = [ChatTool.model_validate(t) for t in tools] if tools else None
    with pytest.raises(OpenAIToolError, match=words) as e:
        plan_tools(parsed, TypeAdapter(ToolChoice | None).validate_python(choice), None, parser)
    assert e.value.param == param


def test_required_grammar_allows_one_call_without_parallel_calls():
    schema = json.loads(_plan("required", parallel=False).structured_outputs()._text)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert "maxItems" not in json.loads(_plan("required").structured_outputs()._text)


# ---- a real server ----

@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    template.write_text(TEMPLATE)
    with running_server(tiny_llama, "--chat-template", str(template), "--max-model-len", "1024",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def no_spaces(tiny_llama: Path) -> dict[str, int]:
    # the tiny model's free output is noise: it would fill max_tokens with the whitespace JSON
    # allows between its tokens; banned through logit_bias
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip()}


def _accumulate(stream) -> tuple[str, list[dict], str]:
    """What a client makes of a streamed answer: content, tool calls, finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_function_with_valid_arguments(client, no_spaces, stream):
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                  temperature=0.0, logit_bias=no_spaces,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        content, calls, finish = _accumulate(client.chat.completions.create(stream=True, **kwargs))
    else:
        message = (r := client.chat.completions.create(**kwargs)).choices[0].message
        content, finish = message.content or "", r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls]
    assert finish == "stop" and content == ""
    (call,) = calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    args = json.loads(call["arguments"])
    assert args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F")


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_one_of_the_tools(client, no_spaces, stream):
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                  temperature=0.0, logit_bias=no_spaces, tool_choice="required",
                  parallel_tool_calls=False)
    if stream:
        content, calls, finish = _accumulate(client.chat.completions.create(stream=True, **kwargs))
    else:
        r = client.chat.completions.create(**kwargs)
        content, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and content == ""
    (call,) = calls
    args = json.loads(call["arguments"])
    assert (call["name"], set(args)) in (("get_weather", {"city", "unit"}), ("get_time", {"zone"}))


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_hermes_call(client, stream):
    # the model is made to write a Hermes call (guided_choice); the server reads it as a call
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=100, temperature=0.0,
                  extra_body={"guided_choice": ["Checking.\n" + HERMES_CALL]})
    if stream:
        content, calls, finish = _accumulate(client.chat.completions.create(stream=True, **kwargs))
    else:
        r = client.chat.completions.create(**kwargs)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        content = message.content
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls]
    assert finish == "tool_calls"
    assert content.strip() == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "C"})]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_leaves_plain_answers_as_content(client, stream):
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0.0,
                  extra_body={"guided_choice": ["It is <b>sunny</b> <tool"]})
    if stream:
        content, calls, finish = _accumulate(client.chat.completions.create(stream=True, **kwargs))
    else:
        r = client.chat.completions.create(**kwargs)
        content, calls = r.choices[0].message.content, r.choices[0].message.tool_calls
        finish = r.choices[0].finish_reason
    assert (content, calls, finish) == ("It is <b>sunny</b> <tool", [], "stop")


def test_a_conversation_carries_calls_and_results_through_the_template(client, tiny_llama):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                       tool_choice="none", max_tokens=4, temperature=0.0)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason
    # the template saw the call's arguments as a dict (rendered as JSON once, not as a string)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    rendered = tok.apply_chat_template(
        [ASK[0], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]}, messages[2]],
        chat_template=TEMPLATE, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in rendered
    assert "<tool_response>\n21 C, sunny" in rendered
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_required_tool_choice_refuses_a_second_grammar(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                       tool_choice="required", max_tokens=4,
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "tool_choice"
    assert "drop response_format" in e.value.body["message"]


def test_logprobs_are_not_streamed_with_tools(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                       tool_choice="required", max_tokens=4, stream=True,
                                       logprobs=True)
    assert e.value.body["param"] == "logprobs"
