"""Tool calling: the parsers and the streamer on their own, then a real `kvfleet serve
--enable-auto-tool-choice --tool-call-parser hermes` with a Hermes-style chat template, driven by
the official openai client (named, required and auto tool choices, streamed and not, and a
conversation that carries the calls and their results back), and servers with the mistral and
pythonic parsers reading the calls the model is made to write."""

from __future__ import annotations

import json
import random
import re
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
    parse_mistral,
    parse_pythonic,
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


def _is_call_id(parser: str | None, call_id: str) -> bool:
    """Mistral's templates take 9 letters and digits as a call id; the rest OpenAI's call_..."""
    if parser == "mistral":
        return re.fullmatch(r"[A-Za-z0-9]{9}", call_id) is not None
    return call_id.startswith("call_")


WEATHER_ARGS, TIME_ARGS = {"city": "Paris", "unit": "C"}, {"zone": "UTC"}
NESTED_ARGS = {"filter": {"tags": ["a", {"x": "}]"}], "n": None, "ok": True},
               "ratio": -2.5e-3, "pages": [1, [2, 3]]}


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Just words [with brackets].", "Just words [with brackets].", []),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]', None,
     [("get_weather", WEATHER_ARGS)]),
    ('Let me check.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "C"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]', "Let me check.",
     [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]),
    # v11+ tokenizers: name{arguments} per [TOOL_CALLS], [ARGS] optionally between
    ('[TOOL_CALLS]get_weather{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time[ARGS]'
     '{"zone": "UTC"}', None, [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]),
    ("Je vérifie…[TOOL_CALLS]search" + json.dumps(NESTED_ARGS), "Je vérifie…",
     [("search", NESTED_ARGS)]),
    ('[TOOL_CALLS][{"name": "search", "arguments": {"q": "café ☕ 東京"}}]', None,
     [("search", {"q": "café ☕ 東京"})]),
    ('[TOOL_CALLS]search{"q": "\\u00e9t\\u00e9"}', None, [("search", {"q": "été"})]),
    # not calls: the text stays content, whole
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": ',
     '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": ', []),
    ("[TOOL_CALLS]get_time{zone: UTC}", "[TOOL_CALLS]get_time{zone: UTC}", []),
    ('[TOOL_CALLS][{"no_name": 1}]', '[TOOL_CALLS][{"no_name": 1}]', []),
    ('[TOOL_CALLS]not a name{"a": 1}', '[TOOL_CALLS]not a name{"a": 1}', []),
    ('[TOOL_CALLS]get_time["UTC"]', '[TOOL_CALLS]get_time["UTC"]', []),
    ('[TOOL_CALLS]get_time{"zone": "UTC"} and more', '[TOOL_CALLS]get_time{"zone": "UTC"} and more',
     []),
    ("Nothing after [TOOL_CALLS]", "Nothing after [TOOL_CALLS]", []),
    ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
])
def test_mistral_parser(text, content, calls):
    got_content, got_calls = parse_mistral(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert all(_is_call_id("mistral", c.id) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("text", "ids"), [
    # v11+ with call ids (mistral-common's `name[CALL_ID]id[ARGS]{...}`): the model's ids kept
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "C"}'
     '[TOOL_CALLS]get_time[CALL_ID]Zz9Yy8Xx7[ARGS]{"zone": "UTC"}', ["a1B2c3D4e", "Zz9Yy8Xx7"]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}, '
     '"id": "a1B2c3D4e"}, {"name": "get_time", "arguments": {"zone": "UTC"}, "id": "Zz9Yy8Xx7"}]',
     ["a1B2c3D4e", "Zz9Yy8Xx7"]),
    # an id Mistral's templates would refuse (not 9 letters and digits): a new one instead
    ('[TOOL_CALLS]get_weather[CALL_ID]call_1[ARGS]{"city": "Paris", "unit": "C"}'
     '[TOOL_CALLS]get_time[CALL_ID][ARGS]{"zone": "UTC"}', [None, None]),
])
def test_mistral_parser_keeps_the_models_call_ids(text, ids):
    content, calls = parse_mistral(text)
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    for call, expected in zip(calls, ids, strict=True):
        assert _is_call_id("mistral", call.id)
        if expected is not None:
            assert call.id == expected
        else:
            assert call.id not in text


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Paris is sunny.", "Paris is sunny.", []),
    ('[get_weather(city="Paris", unit="C")]', None, [("get_weather", WEATHER_ARGS)]),
    ("[get_weather(city='Paris', unit='C'),\n get_time(zone=\"UTC\"), get_time()]\n", None,
     [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS), ("get_time", {})]),
    ('<|python_start|>[get_time(zone="UTC")]<|python_end|>', None, [("get_time", TIME_ARGS)]),
    ('[search(filter={"tags": ["a", {"x": "}]"}], "n": None, "ok": True}, ratio=-2.5e-3, '
     "pages=[1, [2, 3]])]", None, [("search", NESTED_ARGS)]),
    ('[search(q="café ☕ 東京", n=+3)]', None, [("search", {"q": "café ☕ 東京", "n": 3})]),
    # text before the list: content, as vLLM's parser has it
    ('Sure! [get_time(zone="UTC")]', 'Sure! [get_time(zone="UTC")]', []),
    # not literals, or not calls by keyword: the text stays content
    ("[get_time(zone=UTC)]", "[get_time(zone=UTC)]", []),
    ('[get_time(zone=__import__("os").getcwd())]', '[get_time(zone=__import__("os").getcwd())]',
     []),
    ('[get_time("UTC")]', '[get_time("UTC")]', []),
    ('[get_time(zone="UTC", zone="CET")]', '[get_time(zone="UTC", zone="CET")]', []),
    ("[get_time(**zones)]", "[get_time(**zones)]", []),
    ("[plot(at=(1, 2))]", "[plot(at=(1, 2))]", []),
    ('[plot(at={1: "x"})]', '[plot(at={1: "x"})]', []),
    ("[plot(at=1e999)]", "[plot(at=1e999)]", []),
    ('[plot(at=-"x")]', '[plot(at=-"x")]', []),
    ("[tools.get_time(zone='UTC')]", "[tools.get_time(zone='UTC')]", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ('[get_time(zone="UTC"', '[get_time(zone="UTC"', []),
])
def test_pythonic_parser(text, content, calls):
    got_content, got_calls = parse_pythonic(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert all(_is_call_id("pythonic", c.id) for c in got_calls)


@pytest.mark.parametrize(("parser", "opening"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": '),
    ("llama3_json", '{"name": "f", "parameters": '),
    ("mistral", "[TOOL_CALLS]"),
    ("mistral", "[TOOL_CALLS]f{\"a\": "),
    ("pythonic", "[f(a="),
])
def test_deeply_nested_output_stays_content(parser, opening):
    # past the recursion limit of the json and ast readers: content, not a server error
    text = opening + "[" * 5000
    assert PARSERS[parser](text) == (text, [])


@pytest.mark.parametrize(("parser", "text"), [
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time'
                '{"zone": "UTC"}'),
    ("pythonic", '[get_weather(city="Paris", unit="C"), get_time(zone="UTC")]'),
])
def test_without_parallel_calls_only_the_first_call_is_kept(parser, text):
    _, calls = _plan("auto", parser, parallel=False).parse(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", WEATHER_ARGS)]


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
    ("hermes", '<tool_call>\n{"name": "a\\x", "arguments": {}}'),     # a bad escape: content
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    ("llama3_json", "  Plain words."),
    ("mistral", 'Let me look.\n[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time'
                '[ARGS]{"zone": "CET"}'),
    ("mistral", "Brackets [like these], a [TOOL but no call."),
    ("mistral", "Je vérifie…[TOOL_CALLS]get_time{broken"),
    ("pythonic", '[get_weather(city="Paris", unit="C"), get_time(zone=\'UTC\')]'),
    ("pythonic", ' <|python_start|>[get_time(zone="CET")]<|python_end|>'),
    ("pythonic", "[1] is a footnote, not a call."),
    ("pythonic", "Plain <|python words, été."),
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
            assert all(_is_call_id(parser, calls[i]["id"]) for i in calls)
        else:
            assert content == text and not calls


@pytest.mark.parametrize("parser", ["mistral", "hermes", None])
def test_named_and_required_calls_take_the_servers_call_ids(parser):
    # Mistral's chat templates refuse any id but 9 letters and digits: a mistral server gives
    # such ids to every call, named and required choices' too
    (named,) = _plan("named", parser).parse('{"city": "Paris", "unit": "C"}')[1]
    (required,) = _plan("required", parser).parse(
        '[{"name": "get_time", "parameters": {"zone": "UTC"}}]')[1]
    streamer = _plan("named", parser).streamer()
    (delta,) = streamer.feed('{"city": ')
    streamed = delta["tool_calls"][0]["id"]
    for call_id in (named.id, required.id, streamed):
        assert _is_call_id(parser, call_id), call_id


def test_mistral_auto_tool_choice_keeps_special_tokens_in_the_text():
    # [TOOL_CALLS] is a special token of Mistral's tokenizers: as vLLM, that parser's auto
    # choice turns skip_special_tokens off; other parsers and choices leave it as asked
    from kvfleet_runtime.server.protocol import ChatCompletionRequest
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=[WEATHER])
    for mode, parser, skip in [("auto", "mistral", False), ("auto", "hermes", True),
                               ("none", "mistral", True), ("required", "mistral", True)]:
        params = body.to_sampling_params(8, None, _plan(mode, parser))
        assert params.skip_special_tokens is skip, (mode, parser)


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

def _tool_server(tiny_llama: Path, tmp_path_factory, parser: str):
    template = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    template.write_text(TEMPLATE)
    return running_server(tiny_llama, "--chat-template", str(template), "--max-model-len", "1024",
                          "--enable-auto-tool-choice", "--tool-call-parser", parser,
                          "--served-model-name", "tiny")


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    with _tool_server(tiny_llama, tmp_path_factory, "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return _client(server)


@pytest.fixture(scope="module", params=["mistral", "pythonic"])
def parser_client(request, tiny_llama: Path,
                  tmp_path_factory) -> Iterator[tuple[str, openai.OpenAI]]:
    """(parser, client) of a server started with --tool-call-parser parser."""
    with _tool_server(tiny_llama, tmp_path_factory, request.param) as s:
        yield request.param, _client(s)


@pytest.fixture(scope="module")
def no_spaces(tiny_llama: Path) -> dict[str, int]:
    # the tiny model's free output is noise: it would fill max_tokens with the whitespace JSON
    # allows between its tokens; banned through logit_bias
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip()}


def _answer(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, list[dict], str]:
    """What a client makes of an answer, streamed or not: content ("" for none), tool calls
    ({id, name, arguments}), finish_reason."""
    if stream:
        return _accumulate(client.chat.completions.create(stream=True, **kwargs))
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return choice.message.content or "", calls, choice.finish_reason


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
    content, calls, finish = _answer(client, stream, **kwargs)
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
    content, calls, finish = _answer(client, stream, **kwargs)
    assert finish == "tool_calls" and content == ""
    (call,) = calls
    args = json.loads(call["arguments"])
    assert (call["name"], set(args)) in (("get_weather", {"city", "unit"}), ("get_time", {"zone"}))


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_hermes_call(client, stream):
    # the model is made to write a Hermes call (guided_choice); the server reads it as a call
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=100, temperature=0.0,
                  extra_body={"guided_choice": ["Checking.\n" + HERMES_CALL]})
    content, calls, finish = _answer(client, stream, **kwargs)
    assert finish == "tool_calls"
    assert content.strip() == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "C"})]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_leaves_plain_answers_as_content(client, stream):
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0.0,
                  extra_body={"guided_choice": ["It is <b>sunny</b> <tool"]})
    assert _answer(client, stream, **kwargs) == ("It is <b>sunny</b> <tool", [], "stop")


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


# what the mistral and pythonic servers' model is made to write (guided_choice), and the calls
# and content read from it
PARSER_ANSWERS = {
    "mistral": [
        ('Je vérifie…\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "C"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]', "Je vérifie…"),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time'
         '{"zone": "UTC"}', ""),
    ],
    "pythonic": [
        ("[get_weather(city='Paris', unit='C'), get_time(zone=\"UTC\")]", ""),
        ('<|python_start|>[get_weather(city="Paris", unit="C"),\n get_time(zone="UTC")]'
         "<|python_end|>", ""),
    ],
}
PLAIN = {"mistral": "It is [sunny], no [TOOL", "pythonic": "[1] It is sunny (été)."}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("which", [0, 1])
def test_auto_tool_choice_parses_the_models_mistral_or_pythonic_calls(parser_client, which,
                                                                       stream):
    parser, client = parser_client
    text, want_content = PARSER_ANSWERS[parser][which]
    content, calls, finish = _answer(client, stream, model="tiny", messages=ASK,
                                     tools=[WEATHER, TIME], max_tokens=200, temperature=0.0,
                                     extra_body={"guided_choice": [text]})
    assert finish == "tool_calls"
    assert content.strip() == want_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    assert all(_is_call_id(parser, c["id"]) for c in calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_leaves_plain_mistral_or_pythonic_answers_as_content(parser_client,
                                                                              stream):
    parser, client = parser_client
    answer = _answer(client, stream, model="tiny", messages=ASK, tools=[WEATHER],
                     max_tokens=40, temperature=0.0, extra_body={"guided_choice": [PLAIN[parser]]})
    assert answer == (PLAIN[parser], [], "stop")
