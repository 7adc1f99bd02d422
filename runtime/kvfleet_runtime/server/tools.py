"""Tool calling for /v1/chat/completions (OpenAI's `tools` and `tool_choice`, as vLLM serves them).

- `tool_choice` a named function: the output is that function's arguments, held to its
  `parameters` schema by structured outputs; one tool call, finish_reason "stop".
- `tool_choice: "required"`: the output is a JSON array of {"name", "parameters"} objects, one
  of the tools each (at most one with `parallel_tool_calls: false`), by structured outputs;
  finish_reason "tool_calls".
- `tool_choice: "auto"` (the default when tools are given): the model decides; its text is
  parsed for calls in its own format by the server's `--tool-call-parser` (hermes:
  `<tool_call>{"name", "arguments"}</tool_call>`, Qwen2.5/Qwen3/Hermes; llama3_json: a JSON
  object `{"name", "parameters"}` as the whole answer, Llama 3.1+; mistral: `[TOOL_CALLS]`
  then a JSON array of `{"name", "arguments"}` or, v11+ tokenizers, `name{arguments}` per
  `[TOOL_CALLS]` (`[CALL_ID]id`, `[ARGS]` between), Mistral/Mixtral, with Mistral's 9-character
  call ids (the model's where it wrote them); pythonic: a Python list
  of calls `[f(a=1), g(b="x")]` as the whole answer, read with `ast`, literals only, Llama
  3.2/Llama 4). Needs `--enable-auto-tool-choice`, as vLLM. Text that does not parse as calls
  stays content.
- `tool_choice: "none"`: the tools reach the chat template and nothing is parsed.

Streamed, a named call's arguments and a hermes call's go out as they are generated (its
header once its name is read); a required, llama3_json, mistral or pythonic call goes out whole
when the choice ends (text before a hermes or mistral call streams as content as it comes).
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfleet_runtime.structured_outputs import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class OpenAIToolError(ValueError):
    """A 400 about the request's tools: (message, param)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# ---- request side ----

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ---- response side ----

class FunctionCall(BaseModel):
    name: str
    arguments: str          # JSON text, as OpenAI's


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_ALNUM = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """Mistral's chat templates refuse call ids other than 9 letters and digits (vLLM's)."""
    return "".join(random.choices(_ALNUM, k=9))


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: new_call_id())
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What a request's tools mean for its sampling and its answer."""
    mode: Literal["none", "auto", "required", "named"]
    tools: list[ChatTool]
    name: str | None = None                # the named function
    parser: str | None = None              # the server's --tool-call-parser (auto reads with it)
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the answer is read for tool calls."""
        return self.mode != "none"

    def new_id(self) -> str:
        """A call id: Mistral's 9 letters and digits on a mistral server (its chat templates
        refuse others, named and required choices' calls included), else OpenAI's `call_...`."""
        return new_mistral_call_id() if self.parser == "mistral" else new_call_id()

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer's text keeps special tokens: mistral's `[TOOL_CALLS]` is one (as
        vLLM, which turns skip_special_tokens off for that parser)."""
        return self.mode == "auto" and self.parser == "mistral"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar a named or required choice puts on the output."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.name)
            return StructuredOutputsParams(json=_parameters(tool))
        if self.mode == "required":
            items = {"anyOf": [{"type": "object",
                                "properties": {"name": {"type": "string",
                                                        "enum": [t.function.name]},
                                               "parameters": _parameters(t)},
                                "required": ["name", "parameters"]} for t in self.tools]}
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished choice's text. Text that does not parse as
        calls stays content."""
        if self.mode == "named":
            return None, [ToolCall(id=self.new_id(),
                                   function=FunctionCall(name=self.name, arguments=text))]
        if self.mode == "required":
            calls = _required_calls(text, self.new_id)
            return (text, []) if calls is None else (None, calls[: None if self.parallel else 1])
        if self.mode == "auto":
            content, calls = PARSERS[self.parser](text)
            return content, calls[: None if self.parallel else 1]
        return text, []

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)


def plan_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None,
               parallel_tool_calls: bool | None, auto_parser: str | None) -> ToolPlan:
    """The request's ToolPlan; OpenAIToolError names the field at fault. auto_parser: the
    server's --tool-call-parser when it was started with --enable-auto-tool-choice."""
    tools = tools or []
    for i, t in enumerate(tools):
        if not _NAME.fullmatch(t.function.name):
            raise OpenAIToolError(f"tools[{i}].function.name must be 1-64 letters, digits, _ "
                                  f"or -; got {t.function.name!r}", f"tools.{i}.function.name")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIToolError("tools must have distinct function names", "tools")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    parallel = parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise OpenAIToolError(f"tool_choice names function {choice.function.name!r}, which "
                                  "is not among the tools", "tool_choice")
        return ToolPlan("named", tools, name=choice.function.name, parser=auto_parser,
                        parallel=parallel)
    if choice == "required" and not tools:
        raise OpenAIToolError('tool_choice "required" needs tools', "tool_choice")
    if choice == "auto" and tools:
        if auto_parser is None:
            raise OpenAIToolError('"auto" tool choice requires the server to be started with '
                                  "--enable-auto-tool-choice and --tool-call-parser; or set "
                                  'tool_choice to "required", "none" or a named function',
                                  "tool_choice")
        return ToolPlan("auto", tools, parser=auto_parser, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", tools, parser=auto_parser, parallel=parallel)
    return ToolPlan("none", tools, parser=auto_parser, parallel=parallel)


def template_message_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool_calls with each call's arguments as a dict: chat templates
    iterate over them (`arguments | tojson`, `arguments.items()`), OpenAI sends JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = dict((call or {}).get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass          # a template that wants text gets it as it came
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}


# ---- parsers ----

# what reading a model's text as JSON (or Python) may raise: deep nesting exceeds the recursion
# limit, which is no ValueError
_UNREADABLE = (ValueError, RecursionError)


def _call(obj: Any, arguments_keys: tuple[str, ...],
          new_id: Callable[[], str] = new_call_id) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_id(), function=FunctionCall(name=obj["name"], arguments=text))


def _required_calls(text: str, new_id: Callable[[], str]) -> list[ToolCall] | None:
    try:
        items = json.loads(text)
    except _UNREADABLE:
        return None
    if not isinstance(items, list):
        return None
    calls = [_call(item, ("parameters",), new_id) for item in items]
    return None if any(c is None for c in calls) or not calls else calls


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# streaming: a call's head up to its arguments' first character, and what to hold back at the
# end of a call not yet closed (its object's brace, whitespace, a start of </tool_call>)
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_HERMES_TAIL = re.compile(r"\}?\s*(?:<[/a-z_]*)?$")


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes / Qwen: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    after optional content (the last call's closing tag may be missing at a stop)."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        try:
            call = _call(json.loads(body), ("arguments", "parameters"))
        except _UNREADABLE:
            call = None
        if call is None:
            return text, []       # not calls after all: the text as it is
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.1+: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by
    "; "), optionally after `<|python_tag|>`."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except _UNREADABLE:
            return text, []
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    """Mistral / Mixtral: content, then `[TOOL_CALLS]` and a JSON array of
    `{"name": ..., "arguments": {...}}` (tokenizers before v11), or `[TOOL_CALLS]name{...}`
    per call, `[ARGS]` optionally between the name and its arguments, and `[CALL_ID]id` after
    the name where the model writes its calls' ids (v11+, as mistral-common decodes them).
    Call ids are 9 letters and digits, as Mistral's chat templates require: the model's own
    where it wrote one of that form, else a new one."""
    start = text.find(_MISTRAL_CALLS)
    if start < 0:
        return text, []
    calls = []
    for block in text[start + len(_MISTRAL_CALLS):].split(_MISTRAL_CALLS):
        found = _mistral_calls(block.strip())
        if found is None:
            return text, []       # not calls after all: the text as it is
        calls += found
    content = text[:start].strip()
    return content or None, calls


def _mistral_id(written: Any) -> Callable[[], str]:
    """The call id maker for a call whose model wrote `written` as its id (or nothing)."""
    if isinstance(written, str) and _MISTRAL_ID.fullmatch(written.strip()):
        return lambda: written.strip()
    return new_mistral_call_id


def _mistral_calls(block: str) -> list[ToolCall] | None:
    """The calls after one `[TOOL_CALLS]`; None unless the whole block is calls."""
    try:
        if block.startswith(("[", "{")):                  # [{"name", "arguments"}, ...]
            items = json.loads(block)
            items = [items] if isinstance(items, dict) else items
            if not isinstance(items, list) or not items:
                return None
            calls = [_call(item, ("arguments",), _mistral_id(item.get("id")))
                     if isinstance(item, dict) else None for item in items]
            return None if any(c is None for c in calls) else calls
        head, brace, arguments = block.partition("{")     # name[CALL_ID]id[ARGS]{...}
        head = head.replace(_MISTRAL_ARGS, "")
        name, _, written_id = head.partition(_MISTRAL_CALL_ID)
        name = name.strip()
        arguments = json.loads(brace + arguments)
    except _UNREADABLE:
        return None
    if not _NAME.fullmatch(name) or not isinstance(arguments, dict):
        return None
    return [_call({"name": name, "arguments": arguments}, ("arguments",), _mistral_id(written_id))]


_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"


def parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.2 / Llama 4: the whole answer is a Python list of calls by keyword,
    `[get_weather(city="Paris"), search(q='x')]`, optionally inside `<|python_start|>` and
    `<|python_end|>` (Llama 4). Read with `ast`, nothing evaluated: arguments are literals only
    (strings, numbers, True/False/None, lists, dicts with string keys)."""
    body = text.strip().removeprefix(_PYTHON_START).strip().removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = [_python_call(node) for node in tree.elts]
    except (SyntaxError, MemoryError, *_UNREADABLE):
        return text, []
    return None, calls


def _python_call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call with keyword arguments")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:      # **spread, or repeated
            raise ValueError("not a call with keyword arguments")
        arguments[keyword.arg] = _python_literal(keyword.value)
    return ToolCall(function=FunctionCall(name=node.func.id,
                                          arguments=json.dumps(arguments, ensure_ascii=False)))


def _python_literal(node: ast.expr | None) -> Any:
    """The value of a literal JSON can hold; ValueError for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        # -1, -2.5: in Python's syntax, an operator on a number
        number = node.operand.value if isinstance(node.operand, ast.Constant) else None
        if type(number) not in (int, float):
            raise ValueError("a sign on something else than a number")
        return _python_literal(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, str | bool | int) or (
                isinstance(value, float) and math.isfinite(value)):
            return value
    if isinstance(node, ast.List):
        return [_python_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_python_literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return dict(zip(keys, (_python_literal(v) for v in node.values), strict=True))
    raise ValueError("not a literal")


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral,
           "pythonic": parse_pythonic}
# streaming: parsers whose calls follow content after a tag (held back from the tag on), and
# those whose whole answer is the calls (held back from its first character, when it is one
# of these starts)
_CALL_TAGS = {"hermes": _HERMES_OPEN, "mistral": _MISTRAL_CALLS}
_ANSWER_STARTS = {"llama3_json": ("{", _PYTHON_TAG), "pythonic": ("[", _PYTHON_START)}


# ---- streaming ----

@dataclass
class ToolStreamer:
    """One streamed choice under a ToolPlan: text deltas in, chat deltas out (as dicts of
    DeltaMessage's fields: content and/or tool_calls)."""
    plan: ToolPlan
    text: str = ""
    sent: int = 0                 # chars of text sent as content
    holding: bool = False         # auto: the rest is (maybe) a call, held to the end
    named_id: str | None = None
    # hermes: per call streamed so far, the chars of its arguments sent
    streamed: list[int] = field(default_factory=list)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            if self.named_id is None:
                self.named_id = self.plan.new_id()
                return [_call_delta(0, delta, self.named_id, self.plan.name)]
            return [_call_delta(0, delta)] if delta else []
        if mode == "required":
            return []
        parser = self.plan.parser
        if self.holding:
            return self._hermes_calls(final=False) if parser == "hermes" else []
        # auto: content until the text may be a call; the rest is held
        if parser in _ANSWER_STARTS:
            stripped = self.text.lstrip()
            if not stripped:
                return []
            if stripped.startswith(tuple(s[:len(stripped)] for s in _ANSWER_STARTS[parser])):
                self.holding = True
                return []
            return self._content(len(self.text))
        tag = _CALL_TAGS[parser]
        found = self.text.find(tag)
        if found >= 0:
            self.holding = True
            calls = self._hermes_calls(final=False) if parser == "hermes" else []
            return self._content(found) + calls
        return self._content(len(self.text) - partial_suffix(self.text, tag))

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The choice's last deltas, and whether it made tool calls."""
        if self.plan.mode == "named":
            return [], True
        if self.streamed:          # hermes calls already under way: their arguments' ends
            return self._hermes_calls(final=True), True
        _, calls = self.plan.parse(self.text)
        out = []
        if not calls:                   # all of it was content: what was held goes now
            rest = self.text[self.sent:]
            if rest:
                out.append({"content": rest})
            return out, False
        if self.plan.mode == "auto" and self.plan.parser in _CALL_TAGS:
            tag = _CALL_TAGS[self.plan.parser]
            tail = self.text[self.sent:self.text.find(tag)]     # held back before the tag
            if tail.strip():
                out.append({"content": tail})
        out += [_call_delta(i, c.function.arguments, c.id, c.function.name)
                for i, c in enumerate(calls)]
        return out, True

    def _hermes_calls(self, final: bool) -> list[dict[str, Any]]:
        """Hermes calls streamed as they are written: a call's header (index, id, name) once
        `{"name": ..., "arguments": ` is read, then its arguments' text as it comes, holding
        back what may be the call object's closing brace or the closing tag. A call in another
        shape (keys in another order) goes out whole at the end instead (finish)."""
        start = self.text.find(_HERMES_OPEN)
        blocks = self.text[start + len(_HERMES_OPEN):].split(_HERMES_OPEN)
        out = []
        for i, block in enumerate(blocks[:None if self.plan.parallel else 1]):
            body, tag, _ = block.partition(_HERMES_CLOSE)
            closed = bool(tag) or final
            head = _HERMES_HEAD.match(body)
            if head is None:
                break
            if i == len(self.streamed):
                try:
                    name = json.loads(f'"{head[1]}"')
                except ValueError:       # a bad escape: not a call; finish sends the text
                    break
                self.streamed.append(0)
                out.append(_call_delta(i, "", new_call_id(), name))
            raw = body[head.end():]
            if closed:
                args = raw.rstrip()
                args = args[:-1].rstrip() if args.endswith("}") else args   # the call's brace
            else:
                args = raw[:_HERMES_TAIL.search(raw).start()]
            sent = self.streamed[i]
            if len(args) > sent:
                self.streamed[i] = len(args)
                out.append(_call_delta(i, args[sent:]))
            if not closed:
                break
        return out

    def _content(self, upto: int) -> list[dict[str, Any]]:
        if upto <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:upto], upto
        return [{"content": piece}]


def _call_delta(index: int, arguments: str, call_id: str | None = None,
                name: str | None = None) -> dict[str, Any]:
    """A chat delta for tool call `index`: its first one carries the id, type and name."""
    call = DeltaToolCall(index=index, id=call_id, type="function" if call_id else None,
                         function=DeltaFunctionCall(name=name, arguments=arguments))
    return {"tool_calls": [call.model_dump(exclude_none=True)]}


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a start of tag (held back: it may
    become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
