"""OpenAI's Responses API (`POST /v1/responses`) through the official openai client against real
`kvfleet serve` processes of a tiny random Llama: the same tokens as chat completions for the
same conversation, the stream's events, incomplete answers, the in-memory store behind
previous_response_id and GET / DELETE, errors naming the field, usage, metrics and aborts (in
the server's process and with the engine in a process of its own); then a server with a
Hermes template, the hermes tool-call parser and the qwen3 reasoning parser, whose model is
made (structured outputs) to think and to call tools: function_call and reasoning items,
streamed and not, and conversations that carry calls and their results."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from kvfleet_runtime.server.protocol import OpenAIError
from kvfleet_runtime.server.responses import ResponseStore, StoredResponse, items_as_messages
from support.server import ServerProcess, leave_mid_stream, running_server, spawned_child
from transformers import AutoTokenizer

from .test_tools import ASK, HERMES_CALL, TEMPLATE, TIME, WEATHER

NAME = "tiny"
# greedy, fixed length: the tiny model's EOS would otherwise end outputs at random places
FIXED = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
CONVERSATION = [  # (Responses input item, the chat message it stands for)
    ({"role": "developer", "content": "Answer briefly."},
     {"role": "system", "content": "Answer briefly."}),
    ({"role": "user", "content": [{"type": "input_text", "text": "What is the capital "},
                                  {"type": "input_text", "text": "of France?"}]},
     {"role": "user", "content": "What is the capital of France?"}),
    ({"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
      "content": [{"type": "output_text", "text": "Paris.", "annotations": []}]},
     {"role": "assistant", "content": "Paris."}),
    ({"type": "message", "role": "user", "content": "And of Italy?"},
     {"role": "user", "content": "And of Italy?"}),
]
ITEMS = [item for item, _ in CONVERSATION]
MESSAGES = [message for _, message in CONVERSATION]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)


# the plain server, and (where the engine path matters: parity, streams, aborts) the same with
# the engine in a process of its own
@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "512") as s:
        yield s


@pytest.fixture(scope="module")
def process_server(tiny_llama: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "512",
                        "--engine-process") as s:
        yield s


@pytest.fixture(params=["thread", "engine-process"])
def any_server(request) -> ServerProcess:
    return request.getfixturevalue("server" if request.param == "thread" else "process_server")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return _client(server)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kwargs):
    return client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens,
                                          **kwargs)


def test_greedy_output_equals_chat_completions_for_the_same_conversation(any_server) -> None:
    client = _client(any_server)
    r = client.responses.create(model=NAME, input=ITEMS, max_output_tokens=12, **FIXED)
    chat = _chat(client, MESSAGES, 12, **FIXED)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [(c.type, c.annotations) for c in item.content] == [("output_text", [])]
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_a_string_input_is_one_user_message_and_instructions_a_system_one(client,
                                                                          tokenizer) -> None:
    r = client.responses.create(model=NAME, input="Hello there", instructions="Be kind.",
                                max_output_tokens=6, **FIXED)
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello there"}]
    assert r.output_text == _chat(client, messages, 6, **FIXED).choices[0].message.content
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert r.usage.input_tokens == len(templated)
    assert r.instructions == "Be kind."


def test_parameters_are_echoed(client) -> None:
    r = client.responses.create(model=NAME, input="Hi", max_output_tokens=3, temperature=0.0,
                                top_p=0.5, metadata={"team": "a"}, user="u-1",
                                parallel_tool_calls=False, store=False,
                                extra_body={"ignore_eos": True})
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.0, 0.5, 3)
    assert (r.metadata, r.user, r.parallel_tool_calls, r.store) == ({"team": "a"}, "u-1", False,
                                                                     False)
    assert (r.tool_choice, r.tools, r.text.format.type) == ("auto", [], "text")
    assert r.created_at <= time.time() and r.error is None and r.background is False


def test_max_output_tokens_ends_it_incomplete(client) -> None:
    r = client.responses.create(model=NAME, input="Tell me a story", max_output_tokens=5, **FIXED)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete" and r.usage.output_tokens == 5
    assert r.completed_at is None


# the tiny model's free output is noise: structured outputs make it end on its own ("stop")
SAY = {"structured_outputs": {"choice": ["Bonjour tout le monde, ça va?"]}}


def _events(client: openai.OpenAI, **kwargs) -> list:
    return list(client.responses.create(model=NAME, stream=True, **kwargs))


def test_streamed_events_come_in_order_and_join_to_the_response(any_server) -> None:
    client = _client(any_server)
    kwargs = dict(input=ITEMS, temperature=0.0, max_output_tokens=40, extra_body=SAY)
    whole = client.responses.create(model=NAME, **kwargs)
    events = _events(client, **kwargs)
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 3
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2]} == {item_id} == {final.output[0].id}
    assert all(e.output_index == 0 and e.content_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == final.output_text == whole.output_text
    assert text == "Bonjour tout le monde, ça va?"
    assert final.status == whole.status == "completed"
    # (cached tokens differ: the second asks what the first put in the prefix cache)
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == \
        (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens)
    assert events[-2].item.status == "completed" and events[-2].item.content[0].text == text


def test_the_clients_stream_helper_gets_the_final_response(client) -> None:
    with client.responses.stream(model=NAME, input="Hi", temperature=0.0, max_output_tokens=40,
                                 extra_body=SAY) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "Bonjour tout le monde, ça va?"
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_streamed_answer_cut_at_max_output_tokens_ends_with_response_incomplete(client) -> None:
    events = _events(client, input="Tell me a story", max_output_tokens=5, **FIXED)
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete" and final.usage.output_tokens == 5
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        final.output_text


async def test_the_async_client_streams(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    stream = await client.responses.create(model=NAME, input="async?", stream=True,
                                           max_output_tokens=4, **FIXED)
    events = [e async for e in stream]
    assert events[-1].type == "response.incomplete"
    assert "".join(getattr(e, "delta", "") for e in events) == events[-1].response.output_text
    await client.close()


def test_previous_response_id_continues_the_conversation(client, tokenizer) -> None:
    first = client.responses.create(model=NAME, input="My name is Ann.", instructions="Be brief.",
                                    max_output_tokens=5, **FIXED)
    second = client.responses.create(model=NAME, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=5, **FIXED)
    # the earlier turn and its answer come first; its instructions do not carry over
    messages = [{"role": "user", "content": "My name is Ann."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    chat = _chat(client, messages, 5, **FIXED)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens == len(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    assert second.previous_response_id == first.id
    # the same turn again: its prompt's full blocks come from the prefix cache
    again = client.responses.create(model=NAME, input="What is my name?",
                                    previous_response_id=first.id, max_output_tokens=5, **FIXED)
    assert again.output_text == second.output_text
    assert again.usage.input_tokens_details.cached_tokens >= 16


def test_stored_responses_are_retrieved_and_deleted(client) -> None:
    r = client.responses.create(model=NAME, input="Keep me", max_output_tokens=3, **FIXED)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    assert client.responses.delete(r.id) is None
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert f"'{r.id}' not found" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=NAME, input="x", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=NAME, input="x", max_output_tokens=2, store=False,
                                       **FIXED)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_keeps_the_latest_responses():
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put(StoredResponse({"id": f"resp_{i}"}, []))
    assert store.get("resp_2").response == {"id": "resp_2"} and store.get("resp_1")
    with pytest.raises(OpenAIError, match="'resp_0' not found"):
        store.get("resp_0")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern=r"^[a-z]{1,8}$")
    age: int = pydantic.Field(ge=0, le=120)
    color: Literal["red", "green"]


def test_text_format_json_schema_parses_into_the_clients_model(client, tokenizer) -> None:
    # whitespace banned (logit_bias): JSON allows it between tokens, the tiny model would fill
    # max_output_tokens with it
    spaces = {str(i): -100 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()}
    r = client.responses.parse(model=NAME, input="Describe a person.", text_format=Person,
                               max_output_tokens=150, temperature=0.0,
                               extra_body={"logit_bias": spaces})
    assert r.status == "completed" and isinstance(r.output_parsed, Person)
    assert Person.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema" and r.text.format.name == "Person"
    # any JSON object: the same grammar as chat's response_format (the tiny model's keys are
    # noise that max_output_tokens cuts)
    anything = client.responses.create(model=NAME, input="Any JSON.", max_output_tokens=20,
                                       temperature=0.0, text={"format": {"type": "json_object"}})
    chat = _chat(client, [{"role": "user", "content": "Any JSON."}], 20, temperature=0.0,
                 response_format={"type": "json_object"})
    assert anything.output_text == chat.choices[0].message.content
    assert anything.output_text.startswith("{")


RESPONSES = "/v1/responses"
WEB_SEARCH = {"type": "web_search"}
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}

# (JSON body, status, param, words the message must contain)
ERRORS = [
    ({"input": "x", "model": "gpt-5"}, 404, "model", "'gpt-5' does not exist"),
    ({"input": "x", "tools": [FLAT_WEATHER, WEB_SEARCH]}, 400, "tools",
     "tools[1].type must be function (kvfleet runs no built-in tools"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools",
     "got 'file_search'"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, 400, "tools",
     "tools[0] is not a function tool: name: Field required"),
    ({"input": "x", "tools": [{**FLAT_WEATHER, "name": "bad name!"}], "tool_choice": "none"}, 400,
     "tools.0.name", "tools[0].name must be 1-64 letters"),
    ({"input": "x", "tools": [FLAT_WEATHER]}, 400, "tool_choice",
     '"auto" tool choice requires the server to be started with --enable-auto-tool-choice'),
    ({"input": "x", "tools": [FLAT_WEATHER],
      "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, 400, "tool_choice",
     'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'),
    ({"input": "x", "tools": [FLAT_WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, 400, "tool_choice", "drop text.format"),
    ({"input": "x", "background": True}, 400, "background", "background responses are not"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation", 'truncation "auto" is not'),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include",
     "include is not supported"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, 400, "prompt", "prompt templates"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation", "previous_response_id"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id",
     "'resp_nope' not found"),
    ({"input": []}, 400, "input", "non-empty list of items"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type",
     "input[0].type must be message, function_call, function_call_output or reasoning; got "
     "'item_reference'"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input.0.role",
     "input[0].role must be one of user, system, developer, assistant; got 'tool'"),
    ({"input": ["hi"]}, 400, "input.0", "input[0] must be an object"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "look:"},
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400, "input.0.content.1",
     "input[0].content[1] must be an input_text or output_text part"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, 400,
     "input.0.arguments", "input[0].arguments must be a string; got None"),
    ({"input": "x", "max_output_tokens": 600}, 400, "max_output_tokens",
     "maximum context length is 512 tokens"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens must be"),
    ({"input": "x", "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format", "text.format of type json_schema needs a schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "bogus"}}}}, 400, "text.format",
     'text.format is not valid: Unsupported type "bogus"'),
    ({"input": "x", "bogus": 1}, 400, "bogus", "unknown field 'bogus'"),
    ({"max_output_tokens": 3}, 400, "input", "input is required"),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), ERRORS)
def test_errors_name_the_field(server: ServerProcess, body, status, param, words) -> None:
    r = httpx.post(server.base_url + RESPONSES, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_a_stream_is_refused_before_it_starts(server: ServerProcess) -> None:
    r = httpx.post(server.base_url + RESPONSES, json={"input": "x", "stream": True,
                                                      "tools": [WEB_SEARCH]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = httpx.get(server.base_url + RESPONSES + "/resp_x?stream=true", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_metrics_count_responses_like_chat_ones(server: ServerProcess, client) -> None:
    def counts() -> tuple[float, float, float]:
        return (server.metric("kvfleet_http_requests_total", route=RESPONSES, status="200"),
                server.metric("kvfleet_http_requests_total", route=RESPONSES, status="400"),
                server.metric("kvfleet_request_success_total", finished_reason="length"))
    before = counts()
    client.responses.create(model=NAME, input="count me", max_output_tokens=2, **FIXED)
    _events(client, input="and me", max_output_tokens=2, **FIXED)
    httpx.post(server.base_url + RESPONSES, json={"input": "x", "background": True})
    assert counts() == (before[0] + 2, before[1] + 1, before[2] + 2)
    got = server.metric("kvfleet_http_requests_total", route=RESPONSES + "/{response_id}")
    httpx.get(server.base_url + RESPONSES + "/resp_nope")
    assert server.metric("kvfleet_http_requests_total", route=RESPONSES + "/{response_id}") == \
        got + 1


def test_a_client_that_leaves_mid_stream_aborts_its_request(any_server) -> None:
    body = {"model": NAME, "input": "A long story", "max_output_tokens": 400, "stream": True,
            "ignore_eos": True}
    left = leave_mid_stream(any_server, RESPONSES, body, lines=30)
    assert len([line for line in left.lines
                if line.startswith("event: response.output_text.delta")]) >= 3
    assert left.running == 1


def test_an_engine_that_dies_mid_stream_ends_it_with_response_failed(tiny_llama: Path) -> None:
    # the engine process killed while the answer streams: the stream ends with the API's error
    # and response.failed events (what the text had so far in it), /health turns 503
    body = {"model": NAME, "input": "A long story", "max_output_tokens": 400, "stream": True,
            "ignore_eos": True}
    with running_server(tiny_llama, "--served-model-name", NAME, "--max-model-len", "512",
                        "--engine-process", "--keep-alive-on-engine-death") as server:
        engine = spawned_child(server.pid)
        events = []
        with httpx.Client(base_url=server.base_url, timeout=60) as http, \
                http.stream("POST", RESPONSES, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
                    if len(deltas) == 3 and engine:
                        os.kill(engine, signal.SIGKILL)
                        engine = 0
        types = [e["type"] for e in events]
        assert types[-2:] == ["error", "response.failed"], types[-6:]
        assert "response.completed" not in types and "response.incomplete" not in types
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert events[-2]["message"] == failed["error"]["message"] and failed["error"]["message"]
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        kept = failed["output"][0]["content"][0]["text"] if failed["output"] else ""
        assert streamed.startswith(kept) and len(deltas) >= 3
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert server.get("/health")[0] == 503


# ---- a server with tools and reasoning ----

FLAT_TIME = {"type": "function", **TIME["function"]}
CALL_ARGS = {"city": "Paris", "unit": "C"}


@pytest.fixture(scope="module")
def tools_client(tiny_llama: Path, tmp_path_factory) -> Iterator[openai.OpenAI]:
    template = tmp_path_factory.mktemp("responses") / "hermes.jinja"
    template.write_text(TEMPLATE)
    with running_server(tiny_llama, "--chat-template", str(template), "--max-model-len", "1024",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3", "--served-model-name", NAME) as s:
        yield _client(s)


def _forced(answer: str, **extra) -> dict:
    """The request fields that make the model write answer (then stop)."""
    return {"temperature": 0.0, "max_output_tokens": 200,
            "extra_body": {"structured_outputs": {"choice": [answer]}, **extra}}


def _answer(client: openai.OpenAI, stream: bool, **kwargs):
    """The Response, non-streamed, or the one the stream's last event carries after checking
    that the stream's items (added, deltas, done) agree with it."""
    if not stream:
        return client.responses.create(model=NAME, **kwargs)
    events = _events(client, **kwargs)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    for index, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[0].item.id == item.id
        assert mine[-1].type == "response.output_item.done" and mine[-1].item == item
        deltas = "".join(e.delta for e in mine if e.type.endswith(".delta"))
        if item.type == "function_call":
            assert deltas == item.arguments
            assert mine[-2].type == "response.function_call_arguments.done"
            assert mine[-2].arguments == item.arguments
        elif item.type == "reasoning":
            assert {e.type for e in mine if e.type.endswith(".delta")} == \
                {"response.reasoning_text.delta"}
            assert deltas == item.content[0].text == mine[-3].text
        else:
            assert deltas == item.content[0].text == mine[-3].text
    return final


def _items(response) -> list[tuple]:
    """(type, what it says) of each output item."""
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append((item.type, item.name, json.loads(item.arguments)))
        elif item.type == "reasoning":
            out.append((item.type, item.content[0].text, item.summary))
        else:
            out.append((item.type, item.content[0].text.strip()))
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("before", "message"), [("Checking.\n", [("message", "Checking.")]),
                                                 ("\n\n", [])], ids=["text", "space"])
def test_a_parsed_tool_call_becomes_a_function_call_item(tools_client, stream, before,
                                                         message) -> None:
    # text before the call is a message item; whitespace alone is none (streamed too)
    r = _answer(tools_client, stream, input=ASK, tools=[FLAT_WEATHER, FLAT_TIME],
                **_forced(before + HERMES_CALL))
    assert _items(r) == message + [("function_call", "get_weather", CALL_ARGS)]
    call = r.output[-1]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.status == "completed" and r.tools[0].name == "get_weather"
    assert r.output_text.strip() == before.strip()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("answer", ["It is <b>sunny</b> <tool", "\n \n"], ids=["text", "space"])
def test_an_answer_without_calls_is_one_message(tools_client, stream, answer) -> None:
    r = _answer(tools_client, stream, input=ASK, tools=[FLAT_WEATHER], **_forced(answer))
    assert [(item.type, item.content[0].text) for item in r.output] == [("message", answer)]


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choices_call_a_function(tools_client, tokenizer, stream) -> None:
    spaces = {str(i): -100 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()}
    common = dict(input=ASK, tools=[FLAT_WEATHER, FLAT_TIME], max_output_tokens=120,
                  temperature=0.0, extra_body={"logit_bias": spaces})
    named = _answer(tools_client, stream, tool_choice={"type": "function", "name": "get_weather"},
                    **common)
    ((kind, name, args),) = _items(named)
    assert (kind, name) == ("function_call", "get_weather") and set(args) == {"city", "unit"}
    required = _answer(tools_client, stream, tool_choice="required", parallel_tool_calls=False,
                       **common)
    ((kind, name, args),) = _items(required)
    assert kind == "function_call" and name in ("get_weather", "get_time")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_becomes_a_reasoning_item(tools_client, stream) -> None:
    r = _answer(tools_client, stream, input=ASK,
                **_forced("<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."))
    assert _items(r) == [("reasoning", "\nThe user asks about Paris.\n", []),
                         ("message", "It is sunny.")]
    assert r.output[0].id.startswith("rs_") and r.output_text == "It is sunny."
    reasoning_tokens = r.usage.output_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < r.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_calling(tools_client, stream) -> None:
    r = _answer(tools_client, stream, input=ASK, tools=[FLAT_WEATHER],
                **_forced("<think>I should look it up.</think>\n" + HERMES_CALL))
    assert _items(r) == [("reasoning", "I should look it up.", []),
                         ("function_call", "get_weather", CALL_ARGS)]


def test_function_calls_and_their_outputs_reach_the_template_as_chat_would(tools_client) -> None:
    # a turn's text and calls: one assistant message with tool_calls; each output a tool message
    weather, time_args = '{"city": "Paris", "unit": "C"}', '{"zone": "UTC"}'
    items = ASK + [
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": weather},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": time_args},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C, sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "12:00"}]}]
    messages = ASK + [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": weather}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": time_args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
    r = tools_client.responses.create(model=NAME, input=items, tools=[FLAT_WEATHER, FLAT_TIME],
                                      tool_choice="none", max_output_tokens=6, **FIXED)
    chat = tools_client.chat.completions.create(model=NAME, messages=messages,
                                                tools=[WEATHER, TIME], tool_choice="none",
                                                max_tokens=6, **FIXED)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_items_as_chat_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
            "id": "fc_1", "status": "completed"}
    items = [{"role": "user", "content": "hi"}, call,
             {"type": "function_call_output", "call_id": "c1", "output": "done"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Now "},
                          {"type": "refusal", "refusal": "no."}]},
             {**call, "call_id": "c2"}, {**call, "call_id": "c3", "name": "g"},
             {"type": "function_call_output", "call_id": "c9", "output": "?"}]
    tool_call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert items_as_messages(items) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", **tool_call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done", "name": "f"},
        {"role": "assistant", "content": "Now no.", "tool_calls": [
            {"id": "c2", **tool_call},
            {"id": "c3", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "?"}]


def test_a_call_continued_with_previous_response_id_carries_the_call(tools_client) -> None:
    first = tools_client.responses.create(model=NAME, input=ASK, tools=[FLAT_WEATHER],
                                          **_forced(HERMES_CALL))
    (call,) = first.output
    second = tools_client.responses.create(
        model=NAME, previous_response_id=first.id, tools=[FLAT_WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
        max_output_tokens=6, **FIXED)
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"}]
    chat = tools_client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER],
                                                tool_choice="none", max_tokens=6, **FIXED)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
