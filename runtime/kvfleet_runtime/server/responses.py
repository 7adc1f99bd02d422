"""OpenAI's Responses API (`POST /v1/responses`, as vLLM serves it), run on the chat path.

A request becomes a chat completion request (`ResponsesRequest.chat_request`): `instructions`
a system message first, the `input` items chat messages (`input_messages`: messages, and an
earlier turn's `function_call` / `function_call_output` items as an assistant message's
tool_calls and `tool` messages), the flat function tools the chat's tools, `text.format` its
response_format, `max_output_tokens` its max_completion_tokens; vLLM's sampling extras pass
through. The chat path templates, samples and parses it (the tool-call and reasoning parsers)
as it does /v1/chat/completions; what it parsed comes back as the API's output items
(`reasoning`, `message`, `function_call`): whole (`output_items`), or as the API's stream
events (`ResponseEvents`). `ResponseStore` keeps the latest stored responses in memory, for
`previous_response_id` and GET / DELETE /v1/responses/{id}.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvfleet_runtime.server import protocol as p
from kvfleet_runtime.server.tools import ChatTool, FunctionDefinition, NamedToolChoice, ToolCall

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# responses kept for previous_response_id and GET /v1/responses/{id}; past it the oldest goes
MAX_STORED_RESPONSES = 1024


def new_id(prefix: str) -> str:
    """OpenAI's ids: resp_..., msg_..., rs_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request ----

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Strict):
    """A Responses function tool: flat, where chat's nests its function."""
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None      # echoed; no effect


class ReasoningConfig(_Strict):
    effort: str | None = None               # the chat template's reasoning_effort
    summary: str | None = None              # echoed; no summaries are written
    generate_summary: str | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None     # echoed; events carry no obfuscation padding


class ResponsesRequest(p.SamplingExtras):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None     # the prefix cache needs no key
    service_tier: str | None = None
    max_tool_calls: int | None = None       # counts built-in tool calls, of which there are none
    # accepted at their neutral values only (check_supported)
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    # vLLM's chat extra
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """A 400 naming the field for what kvfleet does not do."""
        refused = [
            ("background", bool(self.background),
             "background responses are not supported; leave background unset or false"),
            ("prompt", self.prompt is not None,
             "stored prompt templates are not supported; send instructions and input instead"),
            ("conversation", self.conversation is not None,
             "conversations are not supported; chain responses with previous_response_id"),
            ("truncation", self.truncation == "auto",
             'truncation "auto" is not supported: a prompt longer than the context is a 400; '
             'leave truncation unset or "disabled"'),
            ("include", bool(self.include),
             f"include is not supported (no logprobs, encrypted reasoning or tool outputs to "
             f"add); got {self.include}"),
            ("top_logprobs", bool(self.top_logprobs), "top_logprobs are not supported"),
        ]
        for param, bad, message in refused:
            if bad:
                raise p.OpenAIError(message, param=param)

    @cached_property
    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise p.OpenAIError(
                    f"tools[{i}].type must be function (kvfleet runs no built-in tools: no web "
                    f"or file search, code interpreter, MCP, ...); got {kind!r}", param="tools")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as e:
                error = e.errors()[0]
                where = ".".join(str(x) for x in error["loc"])
                raise p.OpenAIError(f"tools[{i}] is not a function tool: {where}: {error['msg']}",
                                    param="tools") from None
        return tools

    def chat_request(self, conversation: list[dict[str, Any]]) -> p.ChatCompletionRequest:
        """The chat completion request the chat path runs: the instructions, then the
        conversation (earlier turns and this input, as chat messages)."""
        self.check_supported()
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        template_kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort is not None:
            template_kwargs.setdefault("reasoning_effort", self.reasoning.effort)
        tools = [ChatTool(type="function",
                          function=FunctionDefinition(**t.model_dump(exclude={"type"})))
                 for t in self.function_tools]
        extras = {name: getattr(self, name) for name in p.SamplingExtras.model_fields}
        return p.ChatCompletionRequest(
            model=self.model, messages=system + conversation,
            max_completion_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, stream=bool(self.stream), user=self.user, tools=tools or None,
            tool_choice=self._chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(),
            chat_template_kwargs=template_kwargs or None, **extras)

    def _chat_tool_choice(self) -> str | NamedToolChoice | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if (isinstance(choice, dict) and choice.get("type") == "function"
                and isinstance(choice.get("name"), str) and set(choice) == {"type", "name"}):
            return NamedToolChoice(type="function", function={"name": choice["name"]})
        raise p.OpenAIError('tool_choice must be "none", "auto", "required" or {"type": '
                            f'"function", "name": ...}}; got {choice!r}', param="tool_choice")

    def _response_format(self) -> p.ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return p.ResponseFormat(type="json_object")
        if fmt.schema_ is None:
            raise p.OpenAIError("text.format of type json_schema needs a schema",
                                param="text.format")
        return p.ResponseFormat(type="json_schema", json_schema=p.JSONSchemaFormat.model_validate(
            {"name": fmt.name or "response", "description": fmt.description,
             "schema": fmt.schema_, "strict": fmt.strict}))

    def echo(self) -> dict[str, Any]:
        """The request's parameters as the Response object repeats them."""
        text = self.text.model_dump(exclude_none=True, by_alias=True) if self.text else {}
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls, "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "prompt_cache_key": self.prompt_cache_key,
            "reasoning": self.reasoning.model_dump() if self.reasoning else None,
            "safety_identifier": self.safety_identifier,
            "service_tier": self.service_tier or "auto", "store": self.store is not False,
            "text": {"format": {"type": "text"}, **text},
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "tools": [t.model_dump() for t in self.function_tools],
            "top_logprobs": self.top_logprobs or 0, "truncation": "disabled", "user": self.user,
            "background": False,
        }


def input_messages(input: str | list[Any]) -> list[dict[str, Any]]:
    """A request's input as chat messages (see items_as_messages); a string is a user
    message."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    if not input:
        raise p.OpenAIError("input must be a string or a non-empty list of items", param="input")
    return items_as_messages(input)


def items_as_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input or output items as chat messages, in order: a message as it is (its text parts
    joined); a turn's function_call items as the tool_calls of one assistant message (its text
    message's, when one came first); a function_call_output as a tool message (with its call's
    name, when the call came before). Reasoning items are left out: chat templates drop earlier
    turns' thinking."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}            # call_id -> function name
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise p.OpenAIError(f"input[{i}] must be an object; got {item!r}", param=f"input.{i}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise p.OpenAIError(f"input[{i}].role must be one of {', '.join(MESSAGE_ROLES)}; "
                                    f"got {role!r}", param=f"input.{i}.role")
            messages.append({"role": role, "content": _text(i, item, "content")})
        elif kind == "function_call":
            call_id, name = _string(i, item, "call_id"), _string(i, item, "name")
            names[call_id] = name
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _string(i, item, "arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(i, item, "call_id")
            message = {"role": "tool", "tool_call_id": call_id,
                       "content": _text(i, item, "output")}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind != "reasoning":
            raise p.OpenAIError(f"input[{i}].type must be message, function_call, "
                                f"function_call_output or reasoning; got {kind!r}",
                                param=f"input.{i}.type")
    return messages


def _string(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise p.OpenAIError(f"input[{i}].{key} must be a string; got {value!r}",
                            param=f"input.{i}.{key}")
    return value


def _text(i: int, item: dict[str, Any], key: str) -> str:
    """A string, or a list of text parts joined (input_text, output_text, refusal)."""
    parts = item.get(key)
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise p.OpenAIError(f"input[{i}].{key} must be a string or a list of content parts; "
                            f"got {parts!r}", param=f"input.{i}.{key}")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        field = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "refusal") or not isinstance(
                part.get(field), str):
            raise p.OpenAIError(f"input[{i}].{key}[{j}] must be an input_text or output_text "
                                f"part with its text (kvfleet serves text: no images, files or "
                                f"audio); got {part!r}"[:300], param=f"input.{i}.{key}.{j}")
        texts.append(part[field])
    return "".join(texts)


# the chat path's names of what a Responses request calls otherwise
_RENAMED = ((re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\btools(\.\d+|\[\d+\])\.function\.name\b"), r"tools\1.name"))


def responses_error(e: p.OpenAIError) -> p.OpenAIError:
    """A chat-path error about the chat request, in the Responses request's names."""
    def rename(text: str) -> str:
        for pattern, name in _RENAMED:
            text = pattern.sub(name, text)
        return text

    param = "input" if e.param == "messages" else e.param and rename(e.param)
    return p.OpenAIError(rename(e.message), status=e.status, param=param, code=e.code,
                         err_type=e.err_type, headers=e.headers)


# ---- output items ----

def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """vLLM's: the thinking as a reasoning_text content part, no summary."""
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(reasoning: str | None, content: str | None, calls: list[ToolCall],
                 status: str) -> list[dict[str, Any]]:
    """A finished answer's items: its reasoning, its text, its calls (those it has); the last
    item takes the response's status when that is incomplete."""
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, "completed"))
    if content:
        items.append(message_item(new_id("msg"), content, "completed"))
    items += [function_call_item(new_id("fc"), c.id, c.function.name, c.function.arguments,
                                 "completed") for c in calls]
    if items and status == "incomplete":
        items[-1]["status"] = "incomplete"
    return items


def usage(input_tokens: int, cached_tokens: int, output_tokens: int,
          reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


# the stream's last event, by the response's status
_END_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete"}


class ResponseEvents:
    """One streamed response's SSE events, sequence-numbered from 0: response.created and
    response.in_progress; then the parsed pieces of the answer (reasoning, content, tool_calls:
    the chat path's parsed_deltas) open, fill and close output items (added, content part
    added, deltas, done); then response.completed (or incomplete, or failed). `items` are the
    closed items: the response's output."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None      # the item being written (in progress)
        self._text = ""                                # its text or arguments so far
        self._space = ""          # whitespace-only text held before a message opens

    def event(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self, response: dict[str, Any]) -> list[str]:
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def feed(self, piece: dict[str, Any]) -> list[str]:
        if "tool_calls" in piece:
            self._space = ""     # whitespace before calls: not in the parsed answer either
            events = []
            for call in piece["tool_calls"]:
                function = call.get("function") or {}
                if "id" in call:                 # a call's first piece: its item opens
                    events += self.close("completed")
                    events += self._start(function_call_item(new_id("fc"), call["id"],
                                                             function.get("name") or "", "",
                                                             "in_progress"))
                events += self._append(function.get("arguments") or "")
            return events
        if "reasoning" in piece:
            events = self._flush_space()
            if self._open is None or self._open["type"] != "reasoning":
                events += self.close("completed")
                events += self._start({"id": new_id("rs"), "type": "reasoning", "summary": [],
                                       "status": "in_progress"})
            return events + self._append(piece["reasoning"])
        text = piece["content"]
        if self._open is None or self._open["type"] != "message":
            if not (self._space + text).strip():
                self._space += text         # held until text follows: it may precede a call
                return []
            text, self._space = self._space + text, ""
            return self.close("completed") + self._start_message() + self._append(text)
        return self._append(text)

    def finish(self, status: str) -> list[str]:
        """The answer's end: the open item closes with the response's status."""
        return self._flush_space() + self.close(status)

    def close(self, status: str) -> list[str]:
        """Close the open item, if any, with status."""
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, index = None, len(self.items)
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "function_call":
            done = {**item, "arguments": text, "status": status}
            events.append(self.event("response.function_call_arguments.done", **where,
                                     name=item["name"], arguments=text))
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status)
            events += [self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=text),
                       self.event("response.content_part.done", **where, content_index=0,
                                  part=done["content"][0])]
        else:
            done = message_item(item["id"], text, status)
            events += [self.event("response.output_text.done", **where, content_index=0,
                                  text=text, logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0,
                                  part=done["content"][0])]
        self.items.append(done)
        return events + [self.event("response.output_item.done", output_index=index, item=done)]

    def end(self, response: dict[str, Any]) -> str:
        return self.event(_END_EVENTS.get(response["status"], "response.failed"),
                          response=response)

    def fail(self, error: p.OpenAIError, response: dict[str, Any]) -> list[str]:
        return [self.event("error", code=error.code, message=error.message, param=error.param),
                self.event("response.failed", response=response)]

    def _start_message(self) -> list[str]:
        return self._start({"id": new_id("msg"), "type": "message", "role": "assistant",
                            "status": "in_progress", "content": []})

    def _flush_space(self) -> list[str]:
        """Held whitespace that no call followed: a message of its own, as in the whole
        answer."""
        if not self._space:
            return []
        text, self._space = self._space, ""
        return self.close("completed") + self._start_message() + self._append(text)

    def _start(self, item: dict[str, Any]) -> list[str]:
        self._open, self._text = item, ""
        where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        events = [self.event("response.output_item.added", output_index=len(self.items),
                             item=item)]
        if item["type"] == "reasoning":
            events.append(self.event("response.content_part.added", **where,
                                     part={"type": "reasoning_text", "text": ""}))
        elif item["type"] == "message":
            events.append(self.event("response.content_part.added", **where,
                                     part=output_text("")))
        return events

    def _append(self, text: str) -> list[str]:
        item = self._open
        if not text or item is None:
            return []
        self._text += text
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "function_call":
            return [self.event("response.function_call_arguments.delta", **where, delta=text)]
        if item["type"] == "reasoning":
            return [self.event("response.reasoning_text.delta", **where, content_index=0,
                               delta=text)]
        return [self.event("response.output_text.delta", **where, content_index=0, delta=text,
                           logprobs=[])]


# ---- store ----

@dataclass
class StoredResponse:
    response: dict[str, Any]
    # every turn so far as chat messages (instructions left out: they do not carry over)
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The latest stored responses, in memory (lost at restart; each server its own), the
    oldest dropped first past max_responses."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES) -> None:
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response["id"]] = stored
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._responses.get(response_id)
        if stored is None:
            raise _not_found(response_id, param)
        return stored

    def delete(self, response_id: str) -> None:
        if self._responses.pop(response_id, None) is None:
            raise _not_found(response_id, None)


def _not_found(response_id: str, param: str | None) -> p.OpenAIError:
    return p.OpenAIError(f"Response with id '{response_id}' not found (responses are kept in "
                         f"memory, the latest {MAX_STORED_RESPONSES}, when created with store "
                         f"true).", status=404, param=param)
