"""The HTTP face of one AsyncLLMEngine: FastAPI routes in OpenAI's wire format, SSE streaming.

Routes: /v1/completions, /v1/chat/completions, /v1/responses (and GET / DELETE
/v1/responses/{id}), /v1/models, /tokenize, /detokenize
(behind --api-key when set), /health, /metrics, /version (always open: probes and
Prometheus do not carry keys). A request's model is a served name (the base model) or a
--lora-modules adapter's (the base model with that adapter). Every error is answered in OpenAI's shape and
counted in kvfleet_http_requests_total; a client that disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfleet_runtime.beam_search import BeamSearchParams
from kvfleet_runtime.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineQueueFullError,
)
from kvfleet_runtime.lora import LoRARequest
from kvfleet_runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvfleet_runtime.sampling_params import SamplingParams
from kvfleet_runtime.server import protocol as p
from kvfleet_runtime.server.embeddings import EmbeddingRequest, create_embeddings
from kvfleet_runtime.server.metrics import HTTPMetrics
from kvfleet_runtime.server.reasoning import (
    ReasoningStreamer,
    num_reasoning_tokens,
    split_reasoning,
)
from kvfleet_runtime.server.responses import (
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    input_messages,
    items_as_messages,
    new_id,
    output_items,
    responses_error,
    usage,
)
from kvfleet_runtime.server.scoring import (
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
    create_classification,
    create_rerank,
    create_score,
)
from kvfleet_runtime.server.tools import (
    OpenAIToolError,
    ToolCall,
    ToolPlan,
    ToolStreamer,
    plan_tools,
)

VERSION = "0.1.0"
# seconds a client should wait after a 503 for a full queue
RETRY_AFTER_S = 1
T = TypeVar("T")
logger = logging.getLogger("kvfleet.serve")


@dataclass(frozen=True)
class LoRAAdapter:
    """A --lora-modules adapter: requests naming it as their model run with its LoRARequest;
    parent: the served name of the base model it adapts (/v1/models); root: its path as given
    (a Hub id, hf://, s3://; None: request.lora_path, the folder read)."""
    request: LoRARequest
    parent: str
    root: str | None = None

    @property
    def name(self) -> str:
        return self.request.lora_name


@dataclass(frozen=True)
class APIOptions:
    """vLLM's server flags of the API's behaviour: response_role (--response-role: the role of
    chat answers), max_logprobs (--max-logprobs: the most logprobs / top_logprobs /
    prompt_logprobs a request may ask), force_include_usage (--enable-force-include-usage:
    streams end with usage even unasked), log_requests (--enable-log-requests: a line a
    generation request), request_id_headers (--enable-request-id-headers: X-Request-Id on every
    answer), docs (off: --disable-fastapi-docs), root_path (--root-path: behind a proxy that
    serves the API under that prefix)."""
    response_role: str = "assistant"
    max_logprobs: int = 20
    force_include_usage: bool = False
    log_requests: bool = False
    request_id_headers: bool = False
    docs: bool = True
    root_path: str = ""


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    served_model_names: list[str]
    api_key: str | None
    registry: CollectorRegistry
    lora_adapters: dict[str, LoRAAdapter] = field(default_factory=dict)     # by name
    last_lora_id: int = 0       # adapters loaded while serving take ids after every one so far
    chat_template: str | None = None      # --chat-template: instead of the tokenizer's
    # what requests leave unset: the model's generation config's (--generation-config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # --enable-auto-tool-choice's --tool-call-parser: tool_choice "auto" reads calls with it
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None     # --reasoning-parser
    # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" unless a request says
    return_tokens_as_token_ids: bool = False
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (vLLM's)
    enable_prompt_tokens_details: bool = False
    responses: ResponseStore = field(default_factory=ResponseStore)    # /v1/responses' store
    options: APIOptions = field(default_factory=APIOptions)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


@dataclass
class CORS:
    """Cross-origin resource sharing, as vLLM's --allowed-origins / --allowed-methods /
    --allowed-headers / --allow-credentials (Starlette's CORSMiddleware does the work)."""
    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool = False


def build_app(engine: AsyncLLMEngine, *, served_model_names: list[str] | None = None,
              lora_adapters: list[LoRAAdapter] | None = None,
              runtime_lora_updating: bool = False, api_key: str | None = None,
              registry: CollectorRegistry | None = None,
              chat_template: str | None = None, cors: CORS | None = None,
              sampling_defaults: dict[str, Any] | None = None,
              tool_call_parser: str | None = None,
              reasoning_parser: str | None = None,
              tokenizer_info: bool = False,
              return_tokens_as_token_ids: bool = False,
              enable_prompt_tokens_details: bool = False,
              options: APIOptions | None = None) -> FastAPI:
    """The app; its lifespan shuts the engine down when the server stops.
    runtime_lora_updating: serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.
    tokenizer_info: serve vLLM's GET /tokenizer_info (--enable-tokenizer-info-endpoint)."""
    state = ServerState(engine=engine,
                        served_model_names=served_model_names or [engine.served_model_name],
                        lora_adapters={a.name: a for a in lora_adapters or []},
                        last_lora_id=max((a.request.lora_int_id for a in lora_adapters or []),
                                         default=0),
                        api_key=api_key or None,
                        registry=registry or CollectorRegistry(),
                        chat_template=chat_template,
                        sampling_defaults=sampling_defaults or {},
                        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                        return_tokens_as_token_ids=return_tokens_as_token_ids,
                        enable_prompt_tokens_details=enable_prompt_tokens_details,
                        options=options or APIOptions())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    docs = state.options.docs
    app = FastAPI(title="kvfleet", version=VERSION, lifespan=lifespan,
                  root_path=state.options.root_path, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.kvfleet = state
    if cors is not None and cors.allowed_origins:
        # browsers' cross-origin calls (a web UI on another origin); preflights are answered
        # here, before the API key is asked for, as the CORS protocol wants
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                           allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                           allow_credentials=cors.allow_credentials)
    if state.options.request_id_headers:
        app.add_middleware(_RequestIdMiddleware)
    # added last: the outermost, so that it counts every answer, preflights included
    app.add_middleware(_HTTPMetricsMiddleware,
                       metrics=HTTPMetrics(state.model_name, state.registry))
    _add_error_handlers(app)
    open_routes = APIRouter()
    keyed_routes = APIRouter(dependencies=[Depends(_check_api_key)])
    _add_open_routes(open_routes)
    _add_keyed_routes(keyed_routes)
    if runtime_lora_updating:
        _add_lora_routes(keyed_routes)
    if tokenizer_info:
        keyed_routes.add_api_route("/tokenizer_info", _tokenizer_info, methods=["GET"])
    app.include_router(open_routes)
    app.include_router(keyed_routes)
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.kvfleet


# ---- errors ----

def _error_response(e: p.OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(p.OpenAIError)
    async def openai_error(_: Request, e: p.OpenAIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        # a JSON syntax error's loc is a character offset, not a field
        param = None if first.get("type") == "json_invalid" else _param_of(first) or None
        return _error_response(p.OpenAIError(_describe_validation_error(first), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(p.OpenAIError(str(e.detail), status=e.status_code,
                                             headers=e.headers))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        return _error_response(p.OpenAIError(f"internal error: {e!r}", status=500))


def _param_of(error: dict[str, Any]) -> str:
    # loc is ("body", field, index, ...); pydantic adds the union member tried ("str", "list[int]")
    parts = [str(x) for x in error.get("loc", ()) if x != "body"]
    return ".".join(x for x in parts if "[" not in x and x not in ("str", "int", "float", "bool"))


def _describe_validation_error(error: dict[str, Any]) -> str:
    param = _param_of(error)
    if error.get("type") == "json_invalid":
        reason = error.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON: {reason}".strip()
    if error.get("type") == "extra_forbidden":
        return f"unknown field {param!r}"
    if error.get("type") == "missing":
        return f"{param} is required"
    if not param:
        return f"the request body must be a JSON object: {error.get('msg')}"
    return f"{param}: {error.get('msg')}; got {error.get('input')!r}"


async def _check_api_key(request: Request) -> None:
    key = _state(request).api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise p.OpenAIError("missing or wrong API key: send 'Authorization: Bearer <key>'",
                            status=401, code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})


class _HTTPMetricsMiddleware:
    """Counts every answer by method, route template (not the raw path) and status."""

    def __init__(self, app: ASGIApp, metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_count(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            route = scope.get("route")
            self.metrics.record(scope["method"], getattr(route, "path", "unmatched"), status)


class _RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every answer carries X-Request-Id, the request's own
    when the client sent one, else a fresh id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = next((v for k, v in scope["headers"] if k == b"x-request-id" and v),
                          uuid.uuid4().hex.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


# ---- open routes ----

def _add_open_routes(router: APIRouter) -> None:
    @router.get("/health")
    @router.get("/ping")            # SageMaker's health check (vLLM serves it too)
    @router.post("/ping")
    async def health(request: Request) -> Response:
        reason = _state(request).engine.death_reason
        if reason is not None:
            raise p.OpenAIError(f"the engine has died: {reason}", status=503)
        return Response(status_code=200)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(_state(request).registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}


# ---- keyed routes ----

# /invocations: the keys that tell a body's kind, in the order they are tried
_INVOCATION_KINDS = [({"messages"}, "chat"), ({"prompt"}, "completion"), ({"input"}, "embed"),
                     ({"text_1"}, "score"), ({"query", "documents"}, "rerank")]

def _add_keyed_routes(router: APIRouter) -> None:
    @router.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        # vLLM's cards: the base model's root is the model as given (a Hub id, a remote URL, a
        # folder); an adapter's is its own path, and its parent the served name it adapts
        state = _state(request)
        config = state.engine.config
        root = config.model_source or config.model
        cards = [p.ModelCard(id=name, root=root, max_model_len=config.max_model_len)
                 for name in state.served_model_names]
        cards += [p.ModelCard(id=a.name, root=a.root or a.request.lora_path, parent=a.parent,
                              max_model_len=config.max_model_len)
                  for a in state.lora_adapters.values()]
        return {"object": "list", "data": [c.model_dump() for c in cards]}

    @router.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await _CompletionCall(_state(request), request, body).run()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await _ChatCall(_state(request), request, body).run()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await _ResponsesCall(_state(request), request, body).run()

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request,
                                stream: bool = False) -> dict[str, Any]:
        if stream:
            raise p.OpenAIError("a stored response is not streamed again (that is background "
                                "mode's, which is not supported); drop stream", param="stream")
        return _state(request).responses.get(response_id).response

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        _state(request).responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _pooling_call(request: Request, body: Any, create: Any, prefix: str) -> Response:
        state = _state(request)
        lora_request = _check_model(state, body.model)
        try:
            result = await _unless_disconnected(request, create(
                state, body, lora_request, p.request_id(prefix, request)))
        except (EngineDeadError, EngineQueueFullError) as e:
            raise _engine_error(e) from None
        if result is None:
            return Response(status_code=499)    # nobody is listening any more
        return JSONResponse(result)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _pooling_call(request, body, create_embeddings, "embd")

    # vLLM's scoring routes (kvfleet_runtime/server/scoring.py)
    @router.post("/score")
    @router.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        return await _pooling_call(request, body, create_score, "score")

    @router.post("/rerank")
    @router.post("/v1/rerank")
    @router.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await _pooling_call(request, body, create_rerank, "rerank")

    @router.post("/classify")
    @router.post("/v1/classify")
    async def classify(body: ClassificationRequest, request: Request) -> Response:
        return await _pooling_call(request, body, create_classification, "classify")

    @router.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one inference route (vLLM's): the body's kind picks the API, as its
        own route would take it: messages -> chat, prompt -> completions, input ->
        embeddings (a classifier's: classify), text_1 -> score, query + documents -> rerank."""
        try:
            raw = await request.json()
        except ValueError as e:
            raise p.OpenAIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise p.OpenAIError("the request body must be a JSON object")
        pooler = _state(request).engine.pooler
        kind = next((kind for keys, kind in _INVOCATION_KINDS if keys <= raw.keys()), None)
        if kind is None:
            raise p.OpenAIError(
                "/invocations takes a chat completion (messages), a completion (prompt), an "
                "embeddings or classification request (input), a score request (text_1, "
                "text_2) or a rerank request (query, documents)")
        if kind == "embed" and (pooler.labels or pooler.classifier_token_ids):
            kind = "classify"
        model, call = invocation_calls[kind]
        try:
            body = model.model_validate(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return await call(body, request)

    invocation_calls = {
        "chat": (p.ChatCompletionRequest, chat_completions),
        "completion": (p.CompletionRequest, completions),
        "embed": (EmbeddingRequest, embeddings), "classify": (ClassificationRequest, classify),
        "score": (ScoreRequest, score), "rerank": (RerankRequest, rerank)}

    @router.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest, request: Request) -> dict[str, Any]:
        state = _state(request)
        _check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise p.OpenAIError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            chat = p.ChatCompletionRequest(messages=body.messages,
                                           add_generation_prompt=body.add_generation_prompt)
            ids = _chat_prompt_ids(state, chat)
        else:
            ids = state.engine.tokenizer.encode(body.prompt,
                                                add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.engine.config.max_model_len,
                "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest, request: Request) -> dict[str, str]:
        state = _state(request)
        _check_model(state, body.model)
        vocab = len(state.engine.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise p.OpenAIError(f"tokens must be ids in [0, {vocab}); got {bad[:5]}",
                                param="tokens")
        return {"prompt": state.engine.tokenizer.decode(body.tokens)}


async def _tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's GET /tokenizer_info: what a client needs to tokenize as the server does (its
    special tokens, chat template, lengths), e.g. lm-evaluation-harness' remote tokenizer,
    which then reads /tokenize and /detokenize: no tokenizer download on the client."""
    state = _state(request)
    tok = state.engine.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        info[name] = str(value) if value is not None else None
    info["chat_template"] = state.chat_template or getattr(tok, "chat_template", None)
    info["model_max_length"] = state.engine.config.max_model_len
    info["add_bos_token"] = getattr(tok, "add_bos_token", None)
    info["vocab_size"] = len(tok)
    return info


def runtime_lora_updating_allowed(environ: dict[str, str]) -> bool:
    """KVFLEET_ALLOW_RUNTIME_LORA_UPDATING (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) is
    true / 1: adapters may be loaded and unloaded while serving."""
    names = ("KVFLEET_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return any(environ.get(n, "").strip().lower() in ("1", "true") for n in names)


def _add_lora_routes(router: APIRouter) -> None:
    """vLLM's runtime adapter routes: an adapter loaded here is read and checked by the engine
    before it is listed; one unloaded is no longer served (requests under way finish)."""
    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: p.LoadLoRAAdapterRequest, request: Request) -> Response:
        state = _state(request)
        if not body.lora_name or not body.lora_path:
            raise p.OpenAIError("Both 'lora_name' and 'lora_path' must be provided.",
                                param="lora_name" if not body.lora_name else "lora_path")
        if body.lora_name in state.lora_adapters or body.lora_name in state.served_model_names:
            raise p.OpenAIError(f"The lora adapter '{body.lora_name}' has already been loaded.",
                                param="lora_name")
        parent = body.base_model_name or state.served_model_names[0]
        if parent not in state.served_model_names:
            raise p.OpenAIError(f"base_model_name must be a served model name "
                                f"({', '.join(state.served_model_names)}); got {parent!r}",
                                param="base_model_name")
        state.last_lora_id += 1
        lora_request = LoRARequest(body.lora_name, state.last_lora_id, body.lora_path)
        try:
            await state.engine.add_lora(lora_request)
        except (EngineDeadError, EngineQueueFullError) as e:
            raise _engine_error(e) from None
        except ValueError as e:
            raise p.OpenAIError(str(e), param="lora_path") from None
        state.lora_adapters[body.lora_name] = LoRAAdapter(lora_request, parent)
        logger.info("loaded LoRA adapter %r from %s", body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                        media_type="text/plain")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: p.UnloadLoRAAdapterRequest, request: Request) -> Response:
        state = _state(request)
        if state.lora_adapters.pop(body.lora_name, None) is None:
            raise p.OpenAIError(f"The lora adapter '{body.lora_name}' cannot be found.",
                                status=404, param="lora_name")
        logger.info("unloaded LoRA adapter %r", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                        media_type="text/plain")


def _check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The adapter a request's model names: None for the base model (a served name, or no
    model given); 404 for a name that is neither."""
    if model is None or model in state.served_model_names:
        return None
    adapter = state.lora_adapters.get(model)
    if adapter is None:
        adapters = (f"; LoRA adapters: {', '.join(state.lora_adapters)}"
                    if state.lora_adapters else "")
        raise p.OpenAIError(f"The model '{model}' does not exist; served: "
                            f"{', '.join(state.served_model_names)}{adapters}", status=404,
                            param="model", code="model_not_found")
    return adapter.request


def _chat_prompt_ids(state: ServerState, body: p.ChatCompletionRequest,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
    tokenizer = state.engine.tokenizer
    if not (state.chat_template or getattr(tokenizer, "chat_template", None)):
        raise p.OpenAIError("this model has no chat template; use /v1/completions, or start "
                            "the server with --chat-template", param="messages")
    try:
        text = tokenizer.apply_chat_template(
            body.template_messages(), chat_template=state.chat_template, tokenize=False,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message, tools=tools,
            **(body.chat_template_kwargs or {}))
    except p.OpenAIError:
        raise
    except Exception as e:      # a template's own raise_exception() names the problem
        raise p.OpenAIError(f"the chat template rejected the messages: {e}",
                            param="messages") from None
    # the template writes BOS itself where the model wants one
    return tokenizer.encode(text, add_special_tokens=False)


# ---- generation calls ----

@dataclass
class _Prompt:
    token_ids: list[int]
    text: str              # for echo
    params: SamplingParams


class _GenerationCall:
    """One completions/chat request: prompts -> engine requests -> one response or an SSE stream."""
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, state: ServerState, request: Request,
                 body: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        self.state = state
        self.request = request
        self.body = body
        self.request_id = p.request_id(self.id_prefix, request, body.request_id)
        self.created = int(time.time())
        self.tokenizer = state.engine.tokenizer
        self.model_name = body.model or state.model_name
        self.prompts: list[_Prompt] = []
        self.sent: dict[int, tuple[int, int]] = {}    # choice index -> (chars, tokens) streamed
        self.done: set[int] = set()                   # choices whose finish was streamed
        # vLLM's --enable-force-include-usage: a stream's usage chunk even when not asked
        self.include_usage = body.include_usage or state.options.force_include_usage
        self.continuous_usage = self.include_usage and bool(
            body.stream_options and body.stream_options.continuous_usage_stats)
        self.prompt_details = state.enable_prompt_tokens_details
        # vLLM's: logprobs' tokens as "token_id:N" (exact ids, whatever their text)
        self.tokens_as_ids = (body.return_tokens_as_token_ids
                              if body.return_tokens_as_token_ids is not None
                              else state.return_tokens_as_token_ids)
        # choice index -> the SSE event of a text-only chunk, split where its text goes
        self._text_events: dict[int, tuple[str, str]] = {}

    # the API-specific parts
    def make_prompts(self) -> list[_Prompt]:
        raise NotImplementedError

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, prompt_index: int, out: RequestOutput) -> list[str]:
        """The SSE events of a request's new output."""
        raise NotImplementedError

    def text_chunk(self, index: int, text: str) -> dict[str, Any]:
        """The chunk of choice index that carries only new text (no logprobs, not finished)."""
        raise NotImplementedError

    async def run(self) -> Response:
        lora_request = _check_model(self.state, self.body.model)
        engine = self.state.engine
        p.check_priority(engine, self.body.priority)
        self.prompts = self.make_prompts()
        self.check_max_logprobs()
        if self.state.options.log_requests:
            self.log_request()
        vocab = len(self.tokenizer)
        for prompt in self.prompts:
            try:
                prompt.params.check_token_ids(vocab)
            except ValueError as e:
                raise p.OpenAIError(str(e), param=str(e).split(" ", 1)[0]) from None
        beams = [self.beam_search_params(pr.params) for pr in self.prompts] \
            if self.body.use_beam_search else None
        try:
            # refuse before the response starts: a stream's status line cannot change later
            # (beam search: each round runs a request a beam)
            engine.check_admission(len(self.prompts) * (self.body.n if beams else 1))
        except (EngineDeadError, EngineQueueFullError) as e:
            raise _engine_error(e) from None
        if beams is not None:
            gens = [engine.beam_search(pr.token_ids, f"{self.request_id}-{i}", beam,
                                       lora_request, self.body.priority,
                                       pr.params.skip_special_tokens)
                    for i, (pr, beam) in enumerate(zip(self.prompts, beams, strict=True))]
        else:
            gens = [engine.generate(pr.token_ids, pr.params, request_id=f"{self.request_id}-{i}",
                                    lora_request=lora_request, priority=self.body.priority)
                    for i, pr in enumerate(self.prompts)]
        if self.body.stream:
            return StreamingResponse(self._sse(gens), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        finals = await _unless_disconnected(self.request, _collect(gens))
        if finals is None:
            return Response(status_code=499)    # nobody is listening any more
        return JSONResponse(self.response(finals))

    def check_max_logprobs(self) -> None:
        """400 naming the field that asks for more logprobs than --max-logprobs allows."""
        limit = self.state.options.max_logprobs
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(self.body, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                raise p.OpenAIError(f"{name} must be at most {limit} (the server's "
                                    f"--max-logprobs); got {value}", param=name)

    def log_request(self) -> None:
        """vLLM's --enable-log-requests: the request's id, model and sizes (not its text)."""
        logger.info("request %s: model %s, prompt tokens %s, max_tokens %s, stream %s",
                    self.request_id, self.model_name,
                    ",".join(str(len(pr.token_ids)) for pr in self.prompts),
                    ",".join(str(pr.params.max_tokens) for pr in self.prompts),
                    str(self.body.stream).lower())

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams:
        """vLLM's use_beam_search: n beams of the prompt's max_tokens; what would change the
        tokens beyond the model's logprobs (stops besides EOS, penalties, biases, grammars)
        or report them (logprobs) is refused naming it (sampling knobs change nothing)."""
        unsupported = [
            ("stop", params.stop), ("stop_token_ids", params.stop_token_ids),
            ("logprobs", params.logprobs is not None), ("prompt_logprobs",
                                                        params.prompt_logprobs is not None),
            ("bad_words", params.bad_words), ("logit_bias", params.logit_bias),
            ("allowed_token_ids", params.allowed_token_ids), ("min_tokens", params.min_tokens),
            ("presence_penalty", params.presence_penalty),
            ("frequency_penalty", params.frequency_penalty),
            ("repetition_penalty", params.repetition_penalty != 1.0),
            ("response_format" if self.body.response_format is not None
             else "structured_outputs", params.structured_outputs is not None)]
        for name, value in unsupported:
            if value:
                raise p.OpenAIError(f"{name} is not supported with use_beam_search", param=name)
        try:
            return BeamSearchParams(
                beam_width=self.body.n, max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos, length_penalty=self.body.length_penalty,
                include_stop_str_in_output=params.include_stop_str_in_output)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise p.OpenAIError(str(e).replace("beam_width", "n (the beam width)", 1),
                                param="n" if name == "beam_width" else name) from None

    def truncated(self, ids: list[int]) -> list[int]:
        return p.truncate_prompt(ids, self.body.truncate_prompt_tokens,
                                 self.state.engine.config.max_model_len)

    def max_tokens_for(self, prompt_len: int, requested: int | None, field: str) -> int:
        """The completion budget; 400 naming the lengths when it does not fit."""
        max_len = self.state.engine.config.max_model_len
        if requested is not None and prompt_len + requested > max_len:
            raise p.OpenAIError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} in {field}). Shorten the prompt or lower {field}.",
                param=field, code="context_length_exceeded")
        if requested is None and prompt_len >= max_len:
            raise p.OpenAIError(
                f"This model's maximum context length is {max_len} tokens. However, the "
                f"prompt has {prompt_len} tokens, leaving none for the completion.",
                param=field, code="context_length_exceeded")
        if requested is not None:
            return requested
        # unset: what is left of the context, or less where the model's generation config says
        return min(max_len - prompt_len,
                   self.state.sampling_defaults.get("max_tokens", max_len - prompt_len))

    def usage(self, outs: list[RequestOutput]) -> p.UsageInfo:
        usage = p.UsageInfo.of(sum(len(o.prompt_token_ids) for o in outs),
                               sum(len(c.token_ids) for o in outs for c in o.outputs))
        if self.prompt_details:     # the prompt tokens the prefix cache held
            usage.prompt_tokens_details = p.PromptTokensDetails(
                cached_tokens=sum(o.num_cached_tokens for o in outs))
        return usage

    def choice_index(self, prompt_index: int, c: CompletionOutput) -> int:
        return prompt_index * self.body.n + c.index

    def delta(self, prompt_index: int, c: CompletionOutput) -> tuple[str, int, int, bool] | None:
        """(new text, chars sent before, tokens sent before, first?) of a choice; marks it sent.

        None once the choice's finish was sent: a request's outputs keep carrying its
        finished samples while its other samples go on.
        """
        index = self.choice_index(prompt_index, c)
        if index in self.done:
            return None
        if c.finished:
            self.done.add(index)
        first = index not in self.sent
        chars, tokens = self.sent.get(index, (0, 0))
        self.sent[index] = (len(c.text), len(c.token_ids))
        return c.text[chars:], chars, tokens, first

    def event(self, chunk: dict[str, Any], usage: tuple[int, int]) -> str:
        """A chunk's SSE event; usage: its request's (prompt, choice) tokens so far."""
        if self.continuous_usage:
            chunk["usage"] = p.UsageInfo.of(*usage).model_dump()
        elif self.include_usage:
            # OpenAI's chunks carry "usage": null only when usage was asked for
            chunk["usage"] = None
        return _sse_event(chunk)

    def text_event(self, index: int, text: str, usage: tuple[int, int]) -> str:
        """event(text_chunk(index, text)) without building it: the commonest event of a stream.

        The chunk's event is rendered once a choice through the same models and json.dumps,
        with a marker for its text, and split there; each event then joins the two halves
        around the text's JSON (~1 us where the models took ~9). With continuous usage
        each chunk differs: built whole.
        """
        if self.continuous_usage:
            return self.event(self.text_chunk(index, text), usage)
        halves = self._text_events.get(index)
        if halves is None:
            before, marker, after = self.event(self.text_chunk(index, _TEXT_MARKER),
                                               usage).partition(_TEXT_MARKER_JSON)
            assert marker and _TEXT_MARKER_JSON not in after, "the marker must occur once"
            halves = self._text_events[index] = (before, after)
        return halves[0] + json.dumps(text, ensure_ascii=False) + halves[1]

    def prompt_logprobs(self, out: RequestOutput) -> p.PromptLogprobs | None:
        """vLLM's prompt_logprobs of out (completions and chat), when the request asked: each
        prompt token's entry and the top k beside it, by token id; None at the first."""
        k = self.body.prompt_logprobs
        if k is None:
            return None
        positions = out.prompt_logprobs or []
        result: p.PromptLogprobs = []
        for pos, token_id in enumerate(out.prompt_token_ids):
            lp = positions[pos] if pos < len(positions) else None
            if not lp:
                result.append(None)
                continue
            # (the engine may hold more: echo's logprobs asked for a larger k)
            result.append({str(t): {"logprob": e.logprob, "rank": e.rank,
                                    "decoded_token": self.decoded(t, lp)}
                           for t, e in lp.items()
                           if t == token_id or e.rank is None or e.rank <= k})
        return result

    def token_str(self, token_id: int, lp: PositionLogprobs | None) -> str:
        """A logprobs entry's token: its text, or "token_id:N" (return_tokens_as_token_ids)."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.decoded(token_id, lp)

    def decoded(self, token_id: int, lp: PositionLogprobs | None) -> str:
        entry = lp.get(token_id) if lp else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id])

    async def _sse(self, gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in _merge(gens):
                for event in self.events(i, out):
                    yield event
                if out.finished:
                    finals[i] = out
            if self.include_usage:
                usage = self.usage([finals[i] for i in sorted(finals)])
                yield _sse_event({"id": self.request_id, "object": self.chunk_object,
                                  "created": self.created, "model": self.model_name,
                                  "choices": [], "usage": usage.model_dump()})
        except (EngineDeadError, EngineQueueFullError, ValueError) as e:
            yield _sse_event(_engine_error(e).body())
        yield "data: [DONE]\n\n"


def _sorted_outputs(out: RequestOutput) -> list[CompletionOutput]:
    outputs = out.outputs
    return outputs if len(outputs) == 1 else sorted(outputs, key=lambda c: c.index)


# stands for a text-only chunk's text while its event is rendered (private-use characters:
# json.dumps(ensure_ascii=False) writes them as they are; no id or model name holds them)
_TEXT_MARKER = "\ue000kvfleet-text\ue001"
_TEXT_MARKER_JSON = json.dumps(_TEXT_MARKER, ensure_ascii=False)


class _CompletionCall(_GenerationCall):
    body: p.CompletionRequest

    def make_prompts(self) -> list[_Prompt]:
        out = []
        vocab = len(self.tokenizer)
        for prompt in self.body.prompts():
            if isinstance(prompt, str):
                ids, text = self.tokenizer.encode(prompt), prompt
            else:
                if any(not 0 <= t < vocab for t in prompt):
                    raise p.OpenAIError(f"prompt token ids must be in [0, {vocab})",
                                        param="prompt")
                # the text only shows with echo: no decode of every token-id prompt
                ids, text = list(prompt), self.tokenizer.decode(prompt) if self.body.echo else ""
            kept = self.truncated(ids)
            if len(kept) < len(ids):          # echo shows what the model saw
                ids, text = kept, self.tokenizer.decode(kept) if self.body.echo else ""
            max_tokens = self.max_tokens_for(len(ids), self.body.max_tokens, "max_tokens")
            params = self.body.to_sampling_params(max_tokens, self.state.sampling_defaults)
            if self.body.echo and self.body.logprobs is not None:
                params.prompt_logprobs = max(params.prompt_logprobs or 0, self.body.logprobs)
            out.append(_Prompt(ids, text, params))
        return out

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = [self._choice(i, out, c, c.text, 0, 0, first=True)
                   for i, out in enumerate(finals) for c in _sorted_outputs(out)]
        return p.CompletionResponse(id=self.request_id, created=self.created,
                                    model=self.model_name, choices=choices,
                                    usage=self.usage(finals)).model_dump()

    def events(self, prompt_index: int, out: RequestOutput) -> list[str]:
        events = []
        text_only = self.body.logprobs is None and not self.body.echo
        for c in _sorted_outputs(out):
            if (delta := self.delta(prompt_index, c)) is None:
                continue
            text, chars, tokens, first = delta
            new_tokens = self.body.logprobs is not None and tokens < len(c.token_ids)
            if not (text or new_tokens or c.finished or (first and self.body.echo)):
                continue
            usage = (len(out.prompt_token_ids), len(c.token_ids))
            if text_only and not c.finished:
                events.append(self.text_event(self.choice_index(prompt_index, c), text, usage))
                continue
            choice = self._choice(prompt_index, out, c, text, chars, tokens, first)
            events.append(self.event(self._chunk(choice), usage))
        return events

    def text_chunk(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk(p.CompletionChoice(index=index, text=text))

    def _chunk(self, choice: p.CompletionChoice) -> dict[str, Any]:
        return p.CompletionChunk(id=self.request_id, created=self.created, model=self.model_name,
                                 choices=[choice]).model_dump(exclude={"usage"})

    def _choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput, text: str,
                text_start: int, token_start: int, first: bool) -> p.CompletionChoice:
        """A choice carrying c's text and tokens from (text_start, token_start) on."""
        echo = self.body.echo and first
        prefix = self.prompts[prompt_index].text if echo else ""
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = p.CompletionLogprobs()
            if echo:
                self._append_logprobs(logprobs, out.prompt_token_ids,
                                      out.prompt_logprobs or [], 0, 0)
            self._append_logprobs(logprobs, c.token_ids, c.logprobs or [], token_start,
                                  len(prefix) + text_start)
        return p.CompletionChoice(index=self.choice_index(prompt_index, c), text=prefix + text,
                                  logprobs=logprobs, finish_reason=c.finish_reason,
                                  stop_reason=c.stop_reason,
                                  prompt_logprobs=self.prompt_logprobs(out) if first else None)

    def _append_logprobs(self, result: p.CompletionLogprobs, token_ids: list[int],
                         logprobs: list[PositionLogprobs | None], start: int,
                         offset: int) -> None:
        for pos in range(start, len(token_ids)):
            lp = (logprobs[pos] if pos < len(logprobs) else None) or {}
            token_id = token_ids[pos]
            token = self.token_str(token_id, lp)
            chosen = lp.get(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(chosen.logprob if chosen is not None else None)
            # (the engine may hold more at a prompt position: prompt_logprobs asked a larger k)
            k = self.body.logprobs
            result.top_logprobs.append({self.token_str(t, lp): e.logprob for t, e in
                                        sorted(lp.items(), key=lambda kv: -kv[1].logprob)
                                        if t == token_id or e.rank is None or e.rank <= k}
                                       or None)
            result.text_offset.append(offset)
            offset += len(token)


class _ChatCall(_GenerationCall):
    body: p.ChatCompletionRequest
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    tools = ToolPlan("none", [])        # make_prompts sets the request's
    reasoning_parser: str | None = None  # and the server's --reasoning-parser

    def make_prompts(self) -> list[_Prompt]:
        body = self.body
        try:
            self.tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                                    self.state.tool_call_parser)
        except OpenAIToolError as e:
            raise p.OpenAIError(str(e), param=e.param) from None
        self.reasoning_parser = self.state.reasoning_parser
        # a streamed choice's parsers: (reasoning, tool calls), either None when not used
        self._streams: dict[int, tuple[ReasoningStreamer | None, ToolStreamer | None]] = {}
        ids = self.truncated(_chat_prompt_ids(self.state, body, self.tools.template_tools()))
        field = ("max_completion_tokens" if body.max_completion_tokens is not None
                 else "max_tokens")
        max_tokens = self.max_tokens_for(len(ids), body.requested_max_tokens(), field)
        return [_Prompt(ids, "", body.to_sampling_params(max_tokens, self.state.sampling_defaults,
                                                         self.tools))]

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        (out,) = finals
        choices = []
        for c in _sorted_outputs(out):
            reasoning, content, calls = self.parsed(c)
            message = p.ChatResponseMessage(role=self.role, content=content, tool_calls=calls)
            if self.reasoning_parser is not None and self.body.include_reasoning:
                message.reasoning = message.reasoning_content = reasoning
            finish_reason = (self._tool_finish_reason(c, bool(calls)) if self.tools.active
                             else c.finish_reason)
            choices.append(p.ChatChoice(index=c.index, message=message,
                                        logprobs=self.logprobs(c, 0), finish_reason=finish_reason,
                                        stop_reason=c.stop_reason))
        return p.ChatCompletionResponse(id=self.request_id, created=self.created,
                                        model=self.model_name, choices=choices,
                                        usage=self.usage(finals),
                                        prompt_logprobs=self.prompt_logprobs(out)).model_dump()

    @property
    def role(self) -> str:
        """The answer's role: the message it continues' (continue_final_message), else the
        server's --response-role (vLLM's)."""
        if self.body.continue_final_message and self.body.messages:
            return self.body.messages[-1].role
        return self.state.options.response_role

    def parsed(self, c: CompletionOutput) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a finished choice, by the server's reasoning
        parser and the request's tools."""
        reasoning, content = None, c.text
        if self.reasoning_parser is not None:
            reasoning, content = split_reasoning(self.reasoning_parser, c.text)
        calls: list[ToolCall] = []
        if self.tools.active:
            content, calls = self.tools.parse(content or "")
        return reasoning, content, calls

    def _tool_finish_reason(self, c: CompletionOutput, called: bool) -> str | None:
        """OpenAI's "tool_calls" when the model chose to call (auto, required); a named call
        ends with "stop"; a cut-off answer keeps "length"."""
        if called and c.finish_reason == "stop" and self.tools.mode in ("auto", "required"):
            return "tool_calls"
        return c.finish_reason

    def events(self, prompt_index: int, out: RequestOutput) -> list[str]:
        if self.tools.active or self.reasoning_parser is not None:
            return self._parsed_events(out)
        events = []
        for c in _sorted_outputs(out):
            if (delta := self.delta(prompt_index, c)) is None:
                continue
            text, _, tokens, first = delta
            usage = (len(out.prompt_token_ids), len(c.token_ids))
            if first:
                events.append(self.event(self._chunk(c.index, p.DeltaMessage(role=self.role,
                                                                            content="")),
                                         (usage[0], 0)))
            if self.body.logprobs:
                if text or tokens < len(c.token_ids):
                    events.append(self.event(self._chunk(c.index, p.DeltaMessage(content=text),
                                                         logprobs=self.logprobs(c, tokens)), usage))
            elif text:
                events.append(self.text_event(c.index, text, usage))
            if c.finished:
                events.append(self.event(self._chunk(c.index, p.DeltaMessage(),
                                                     finish_reason=c.finish_reason), usage))
        return events

    def _parsed_events(self, out: RequestOutput) -> list[str]:
        """A choice's events when its text is split into reasoning and answer and/or the answer
        is read for tool calls (parsed_deltas)."""
        events = []
        for c in _sorted_outputs(out):
            if (delta := self.delta(0, c)) is None:
                continue
            text, _, _, first = delta
            usage = (len(out.prompt_token_ids), len(c.token_ids))
            if first:
                events.append(self.event(self._chunk(c.index, p.DeltaMessage(role=self.role,
                                                                            content="")),
                                         (usage[0], 0)))
            deltas, called = self.parsed_deltas(c, text)
            for d in deltas:
                if "reasoning" in d:
                    if not self.body.include_reasoning:
                        continue
                    d = {"reasoning": d["reasoning"], "reasoning_content": d["reasoning"]}
                events.append(self.event(self._chunk(c.index, p.DeltaMessage(**d)), usage))
            if c.finished:
                events.append(self.event(self._chunk(
                    c.index, p.DeltaMessage(),
                    finish_reason=self._tool_finish_reason(c, called)), usage))
        return events

    def parsed_deltas(self, c: CompletionOutput, text: str) -> tuple[list[dict[str, Any]], bool]:
        """A streamed choice's new text as parsed pieces, in order: {"reasoning": ...} by the
        server's reasoning parser (ReasoningStreamer), {"content": ...} and {"tool_calls": [...]}
        (tools.DeltaToolCall's, dumped) by the request's tools (ToolStreamer); and, once the
        choice has finished, whether it called tools."""
        if c.index not in self._streams:
            parser = self.reasoning_parser
            self._streams[c.index] = (ReasoningStreamer(parser) if parser is not None else None,
                                      self.tools.streamer() if self.tools.active else None)
        thinking, tools = self._streams[c.index]
        reasoning, answer = thinking.feed(text) if thinking is not None else ("", text)
        if c.finished and thinking is not None:
            more = thinking.finish()
            reasoning, answer = reasoning + more[0], answer + more[1]
        deltas: list[dict[str, Any]] = [{"reasoning": reasoning}] if reasoning else []
        called = False
        if tools is not None:
            deltas += tools.feed(answer)
            if c.finished:
                last, called = tools.finish()
                deltas += last
        elif answer:
            deltas.append({"content": answer})
        return deltas, called

    def text_chunk(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk(index, p.DeltaMessage(content=text))

    def _chunk(self, index: int, delta: p.DeltaMessage, logprobs: p.ChatLogprobs | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
        choice = p.ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                    finish_reason=finish_reason)
        data = p.ChatCompletionChunk(id=self.request_id, created=self.created,
                                     model=self.model_name,
                                     choices=[choice]).model_dump(exclude={"usage"})
        # OpenAI's deltas omit the keys they do not change (the last one is {})
        data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return data

    def logprobs(self, c: CompletionOutput, start: int) -> p.ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for pos in range(start, len(c.token_ids)):
            lp = (c.logprobs[pos] if c.logprobs and pos < len(c.logprobs) else None) or {}
            chosen = lp.get(c.token_ids[pos])
            ranked = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:k]
            top = [self._top(t, e.logprob, lp) for t, e in ranked]
            entry = self._top(c.token_ids[pos],
                              chosen.logprob if chosen is not None else float("-inf"), lp)
            content.append(p.ChatTokenLogprob(**entry.model_dump(), top_logprobs=top))
        return p.ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float, lp: PositionLogprobs) -> p.TopLogprob:
        token = self.token_str(token_id, lp)
        return p.TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


class _ResponsesCall(_ChatCall):
    """POST /v1/responses: the request run as a chat completion (ResponsesRequest.chat_request),
    after the stored conversation its previous_response_id names; the parsed answer given back
    as output items, whole or as the API's stream events, and stored unless store is false."""
    responses_body: ResponsesRequest

    def __init__(self, state: ServerState, request: Request, body: ResponsesRequest) -> None:
        _check_model(state, body.model)    # an unknown model is a 404 before the input is read
        history = [] if body.previous_response_id is None else state.responses.get(
            body.previous_response_id, param="previous_response_id").conversation
        self.responses_body = body
        self.conversation = history + input_messages(body.input)
        super().__init__(state, request, body.chat_request(self.conversation))
        self.request_id = new_id("resp")

    def make_prompts(self) -> list[_Prompt]:
        try:
            return super().make_prompts()
        except p.OpenAIError as e:
            raise responses_error(e) from None

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        (out,) = finals
        (c,) = out.outputs
        status = _RESPONSE_STATUS.get(c.finish_reason, "completed")
        return self.keep(self.response_object(output_items(*self.parsed(c), status), status,
                                              self.responses_usage(out)))

    async def _sse(self, gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        stream = ResponseEvents()
        for event in stream.start(self.response_object([], "in_progress")):
            yield event
        try:
            async for _, out in _merge(gens):
                (c,) = out.outputs
                if (delta := self.delta(0, c)) is None:
                    continue
                for piece in self.parsed_deltas(c, delta[0])[0]:
                    for event in stream.feed(piece):
                        yield event
                if out.finished:
                    status = _RESPONSE_STATUS.get(c.finish_reason, "completed")
                    for event in stream.finish(status):
                        yield event
                    yield stream.end(self.keep(self.response_object(
                        stream.items, status, self.responses_usage(out))))
        except (EngineDeadError, EngineQueueFullError, ValueError) as e:
            error = _engine_error(e)
            failed = self.response_object(stream.items, "failed", error={
                "code": "server_error", "message": error.message})
            for event in stream.fail(error, failed):
                yield event

    def response_object(self, output: list[dict[str, Any]], status: str,
                        usage: dict[str, Any] | None = None,
                        error: dict[str, Any] | None = None) -> dict[str, Any]:
        """OpenAI's Response: this response's output and status, the request's parameters
        (temperature and top_p as sampled)."""
        params = self.prompts[0].params
        return {"id": self.request_id, "object": "response", "created_at": self.created,
                "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": error,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "model": self.model_name, "output": output, "usage": usage,
                "temperature": params.temperature, "top_p": params.top_p,
                **self.responses_body.echo()}

    def responses_usage(self, out: RequestOutput) -> dict[str, Any]:
        (c,) = out.outputs
        parser = self.reasoning_parser
        reasoning_tokens = (num_reasoning_tokens(parser, c.token_ids, self.tokenizer.decode)
                            if parser is not None else 0)
        return usage(len(out.prompt_token_ids), out.num_cached_tokens, len(c.token_ids),
                     reasoning_tokens)

    def keep(self, response: dict[str, Any]) -> dict[str, Any]:
        """Store a finished response (unless store is false): its conversation goes on with
        previous_response_id."""
        if response["store"]:
            self.state.responses.put(StoredResponse(
                response, self.conversation + items_as_messages(response["output"])))
        return response


# a finished choice's Response status, by its finish reason (else completed)
_RESPONSE_STATUS = {"length": "incomplete", "abort": "cancelled"}


def _engine_error(e: Exception) -> p.OpenAIError:
    """The HTTP error of what AsyncLLMEngine raises."""
    if isinstance(e, EngineQueueFullError):
        return p.OpenAIError(str(e), status=503, code="queue_full",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return p.OpenAIError(str(e), status=503)
    return p.OpenAIError(str(e))     # ValueError: the engine's own check of the request


async def _collect(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in _merge(gens):
            finals[i] = out
    except (EngineDeadError, EngineQueueFullError, ValueError) as e:
        raise _engine_error(e) from None
    return [finals[i] for i in range(len(gens))]


async def _merge(gens: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come; closing it aborts them all."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await work; None (and work cancelled, so its requests abort) if the client leaves first."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return work_task.result() if work_task.done() else None
    finally:
        work_task.cancel()
        watch.cancel()


async def _disconnected(request: Request) -> None:
    # the body has been read, so the next ASGI message can only be the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
