"""OpenAI wire format: pydantic request/response schemas and their mapping to SamplingParams.

Requests accept the fields of OpenAI's completions and chat completions APIs
plus vLLM's sampling extras (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, ...). Unknown fields are rejected (a typo must not
silently change nothing); fields OpenAI defines that kvfleet does not implement
are accepted only at their neutral value and rejected with a clear message otherwise.
Range checks live in SamplingParams, so the server and the offline API share one rule.
"""

from __future__ import annotations

import re
import time
import uuid
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from kvfleet_runtime import config
from kvfleet_runtime.generation_config import SAMPLING_DEFAULT_KNOBS
from kvfleet_runtime.sampling_params import SamplingParams
from kvfleet_runtime.server.tools import (
    ChatTool,
    ToolCall,
    ToolChoice,
    ToolPlan,
    template_message_tool_calls,
)
from kvfleet_runtime.structured_outputs import StructuredOutputsParams

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type or _ERROR_TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, err_type=self.err_type, param=self.param, code=self.code)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                422: "invalid_request_error", 503: "service_unavailable"}


def error_body(message: str, *, err_type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def check_priority(engine: Any, priority: int) -> None:
    """A request's priority against the engine's scheduling policy: a 400 naming `priority`
    under fcfs for any but 0 (vLLM's refusal)."""
    try:
        config.check_priority(priority, engine.config.scheduling_policy)
    except (TypeError, ValueError) as e:
        raise OpenAIError(str(e), param="priority") from None


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len; None:
    all of them); a 400 naming the field for another value."""
    if k is None:
        return ids
    if k < -1 or k == 0:
        raise OpenAIError(f"truncate_prompt_tokens must be -1 or an integer >= 1; got {k}",
                          param="truncate_prompt_tokens")
    return ids[-(max_model_len if k == -1 else k):]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_id(prefix: str, request: Any, given: str | None = None) -> str:
    """A request's id, vLLM's way: the client's X-Request-Id header, else the body's
    request_id, else a random one, after the API's prefix (cmpl-, chatcmpl-, ...); it names
    the engine's requests too, so one id runs once at a time."""
    header = request.headers.get("x-request-id") if request is not None else None
    return f"{prefix}-{header or given or uuid.uuid4().hex}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingExtras(_Strict):
    """The sampling knobs all three generation APIs take beyond their own: vLLM's extras (seed,
    stop and logit_bias are OpenAI's own in completions and chat; extras in /v1/responses)."""
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    priority: int = 0      # vLLM's: the priority scheduling policy's order (lower first)
    structured_outputs: StructuredOutputs | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class _SamplingRequest(SamplingExtras):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or the
    # guided_* fields of vLLM's earlier releases (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    truncate_prompt_tokens: int | None = None     # keep the prompt's last k tokens (-1: all
                                                  # that fit max_model_len)
    request_id: str | None = None   # vLLM's: the response's id (after its prefix); X-Request-Id wins
    # vLLM's beam search: n beams (at most 10), ranked by cumulative logprob / length **
    # length_penalty (kvfleet_runtime/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: each prompt token's logprob and the top k beside it (not streamed, as vLLM)
    prompt_logprobs: int | None = None
    # vLLM's: logprobs' tokens as "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None

    def _check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true",
                              param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise OpenAIError("prompt_logprobs are not available when stream is true",
                              param="prompt_logprobs")

    def _sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                         defaults: dict[str, Any],
                         tool_grammar: StructuredOutputsParams | None = None,
                         keep_special_tokens: bool = False) -> SamplingParams:
        self._check_unsupported()
        structured = self._structured_outputs
        if tool_grammar is not None:
            if structured is not None:
                raise OpenAIError("a required or named tool_choice structures the output "
                                  "itself: drop response_format / structured_outputs",
                                  param="tool_choice")
            try:
                tool_grammar.check()
            except ValueError as e:
                raise OpenAIError(f"a tool's parameters are not a usable JSON schema: "
                                  f"{str(e).split(': ', 1)[-1]}", param="tools") from None
            structured = tool_grammar
        # None means "the API default" for the knobs OpenAI documents as nullable
        knobs: dict[str, Any] = dict(
            n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, max_tokens=max_tokens, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens and not keep_special_tokens,
            logit_bias=self._logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            cache_salt=self.cache_salt,
            structured_outputs=structured,
            prompt_logprobs=self.prompt_logprobs)
        for name in SAMPLING_DEFAULT_KNOBS:
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)      # the model's generation config, if it says
            if value is not None:
                knobs[name] = value
        try:
            return SamplingParams(**knobs)
        except ValueError as e:
            # SamplingParams says "<field> must be ...; got ...": the field is the param
            raise OpenAIError(str(e), param=str(e).split(" ", 1)[0]) from None

    @cached_property
    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The request's grammar, parsed once for all its prompts (a 400 naming its field when
        it is not valid)."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            if schema is None:
                raise OpenAIError("response_format of type json_schema needs "
                                  "json_schema.schema", param="response_format")
            given.append(("response_format", {"json": schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", {
                "json": so.json_, "regex": so.regex, "choice": so.choice,
                "grammar": so.grammar, "json_object": so.json_object,
                "disable_any_whitespace": so.disable_any_whitespace}))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if not given:
            return None
        if len(given) > 1:
            raise OpenAIError(f"give one way to structure the output; got "
                              f"{', '.join(name for name, _ in given)}", param=given[1][0])
        ((name, spec),) = given
        try:
            params = StructuredOutputsParams(**spec)
            params.check()
        except ValueError as e:
            message = str(e)      # it names structured_outputs' field; the request used another
            if name != "structured_outputs":
                message = re.sub(r"^structured_outputs(\.\w+)?", name, message)
            raise OpenAIError(message, param=name) from None
        return params

    @cached_property
    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias keys are token ids written as strings."""
        if not self.logit_bias:
            return None
        bad = [key for key in self.logit_bias if not (key.isascii() and key.isdigit())]
        if bad:
            raise OpenAIError(f"logit_bias keys must be token ids (non-negative integers); "
                              f"got {bad[0]!r}", param="logit_bias")
        return {int(key): value for key, value in self.logit_bias.items()}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries
        its request's usage so far (the prompt's tokens and its choice's)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]            # one prompt of token ids
        items: list[str | list[int]] = list(p)
        if any((isinstance(x, str) and not x) or (isinstance(x, list) and not x) for x in items):
            raise OpenAIError("prompt must not contain empty prompts", param="prompt")
        return items

    def to_sampling_params(self, max_tokens: int | None,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.suffix is not None:
            raise OpenAIError("suffix is not supported (no fill-in-the-middle); remove it",
                              param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(f"best_of must equal n ({self.n}); got {self.best_of}",
                              param="best_of")
        return self._sampling_params(max_tokens=max_tokens, logprobs=self.logprobs,
                                     defaults=defaults or {})


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra keys (name, tool_call_id, ...) are passed to the chat template untouched
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted and ignored: they change nothing in the answer
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True        # with --reasoning-parser: false drops the reasoning

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (role + plain text content)."""
        if not self.messages:
            raise OpenAIError("messages must contain at least one message", param="messages")
        out = []
        for i, m in enumerate(self.messages):
            if m.role not in CHAT_ROLES:
                raise OpenAIError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; "
                                  f"got {m.role!r}", param=f"messages.{i}.role")
            # the templates we ship know "system"; OpenAI's "developer" is its newer name
            role = "system" if m.role == "developer" else m.role
            message = {**(m.model_extra or {}), "role": role, "content": m.text()}
            out.append(template_message_tool_calls(message) if role == "assistant" else message)
        return out

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int | None,
                           defaults: dict[str, Any] | None = None,
                           tools: ToolPlan | None = None) -> SamplingParams:
        if tools is not None and tools.active and self.stream and self.logprobs:
            raise OpenAIError("logprobs are not streamed with tools; drop one of them",
                              param="logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise OpenAIError(f"top_logprobs must be an integer in [0, 20]; got "
                              f"{self.top_logprobs}", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(
            max_tokens=max_tokens, logprobs=logprobs, defaults=defaults or {},
            tool_grammar=tools.structured_outputs() if tools is not None else None,
            keep_special_tokens=tools is not None and tools.keeps_special_tokens)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's /v1/load_lora_adapter body."""
    lora_name: str = ""
    lora_path: str = ""
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id accepted, as vLLM's; the name decides)."""
    lora_name: str = ""
    lora_int_id: int | None = None


# ---- responses (plain dataclass-like models; serialized with model_dump) ----

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # --enable-prompt-tokens-details (vLLM's): left out of the JSON when not asked for
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_unasked_details(self, handler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ModelCard(BaseModel):
    """A /v1/models entry, vLLM's shape: root is the model's (or the adapter's) folder; parent
    is, for a LoRA adapter, the served name of the base model it adapts."""
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "kvfleet"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt position (the first None) token id -> its entry
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # --reasoning-parser: the model's thinking (vLLM's field; reasoning_content its earlier name)
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # tools.DeltaToolCall's, dumped
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
