"""`kvfleet serve [MODEL]`: load the model, then serve the OpenAI API with uvicorn.

The engine flags are generated from EngineConfig's fields (`--block-size`,
`--max-num-seqs`, `--enable-prefix-caching/--no-enable-prefix-caching`, ...),
so a new engine knob becomes a flag without touching this file;
`add_engine_args` / `engine_config_from_args` serve any subcommand that builds an engine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import typing
from collections.abc import Callable
from typing import Any

from kvfleet_runtime.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATION_ALIASES,
    QUANTIZATION_METHODS,
    REASONING_PARSERS,
    RUNNERS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from kvfleet_runtime.model_source import resolve, resolve_config

if typing.TYPE_CHECKING:
    from kvfleet_runtime.server.api import LoRAAdapter

# server/tools.py's PARSERS (named here: `kvfleet --help` imports no pydantic)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")

logger = logging.getLogger("kvfleet.serve")

_ENGINE_HELP = {
    "model": "HF folder or .gguf file (default: SmolLM2-135M-Instruct GGUF)",
    "tokenizer": "tokenizer folder (or Hub id), when it is not the model's",
    "revision": "the Hub revision (branch, tag or commit) of a model named by a Hub id ORG/NAME "
                "or hf://ORG/NAME, as hf://ORG/NAME@REVISION names it (vLLM's; with both, they "
                "must agree; a local or S3 model has none) (default: main)",
    "tokenizer_revision": "the Hub revision of the tokenizer: --tokenizer's Hub id's, or the "
                          "model's own tokenizer's, fetched at it when it is not the model's "
                          "revision (vLLM's) (default: the model's)",
    "trust_remote_code": "let the tokenizer run code of its repo (transformers' "
                         "trust_remote_code, vLLM's flag); the models are always kvfleet's own "
                         "code, never a checkpoint's (default: off)",
    "dtype": "compute dtype (auto: the checkpoint's, bf16 for fp32 ones, on a GPU; on a CPU bf16 "
             "for half/quantized checkpoints where the CPU has native bf16, else fp32)",
    "kv_cache_dtype": "KV-cache element type: auto (the compute dtype) or fp8 / fp8_e4m3 "
                      "(e4m3 with the checkpoint's calibrated k_scale / v_scale, else 1.0: twice "
                      "the cached tokens per GiB, slightly less accurate)",
    "device": "cuda, cpu or auto",
    "seed": "engine seed for requests without their own",
    "block_size": "tokens per KV-cache block: 8, 16, 32, 64 or 128",
    "max_num_seqs": "most sequences in one running batch",
    "max_num_batched_tokens": "token budget of one step",
    "max_model_len": "longest prompt + completion (default: the model's)",
    "num_gpu_blocks": "fixed number of KV-cache blocks instead of sizing from memory",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use, in (0, 1]",
    "cpu_kv_cache_gb": "KV-cache size on CPU in GiB",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prefills across steps",
    "long_prefill_token_threshold": "the most tokens of one prompt a step prefills, so that a "
                                    "long prompt shares its steps with the other prompts' "
                                    "prefills (vLLM's; default: 0, the step's whole budget)",
    "admission_headroom": "tokens of growth per running request (up to its max_tokens) kept "
                          "free when admitting new ones: fewer preemptions when the KV cache "
                          "is full (0: admit while blocks remain, as vLLM)",
    "scheduling_policy": "fcfs (first come, first served) or priority: requests' priority field "
                         "orders the queue, lower first, and the lowest running request is "
                         "preempted when KV blocks run out (vLLM's; default: fcfs)",
    "quantization": f"weight quantization: {', '.join(QUANTIZATION_METHODS)} (default: what "
                    "the checkpoint says; vLLM's gptq_marlin / awq_marlin are taken as gptq / awq)",
    "enforce_eager": "no CUDA graphs",
    "tensor_parallel_size": "GPUs to shard the model over",
    "attention_backend": "auto, triton or torch",
    "load_format": "auto (read the checkpoint) or dummy (random weights of the model's shapes)",
    "async_scheduling": "schedule and launch the next step while the device runs this one "
                        "(default: on for CUDA; steps with speculative drafts run synchronously)",
    "speculative_config": "speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (n-gram "
                          "prompt lookup; default: off)",
    "enable_lora": "serve LoRA adapters (PEFT format) beside the base model: requests name one "
                   "as their model (--lora-modules) or offline with lora_request=",
    "max_loras": "most distinct LoRA adapters in one step (each a slot on the device)",
    "max_lora_rank": "largest LoRA rank an adapter may have (slots are sized for it)",
    "max_cpu_loras": "LoRA adapters kept loaded in host memory (default: max_loras)",
    "runner": "vLLM's: pooling serves embeddings, scores and classes only (/v1/embeddings, "
              "/score, /rerank, /classify), refusing generation; generate the reverse; auto "
              "both (default: auto)",
    "hf_overrides": "a JSON object merged into the model's config.json as it is read (vLLM's), "
                    "e.g. '{\"is_matryoshka\": true}' for an embedding model's dimensions "
                    "(default: none)",
    "reasoning_parser": "a thinking model's <think>...</think>: deepseek_r1 (DeepSeek-R1, QwQ) or "
                        "qwen3. The server returns it as the message's reasoning field, apart "
                        "from the answer; structured outputs constrain only the answer after it "
                        "(default: off)",
}
_CHOICES: dict[str, list[str]] = {"dtype": list(DTYPES),
                                  "quantization": [*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES],
                                  "kv_cache_dtype": list(KV_CACHE_DTYPES),
                                  "attention_backend": ["auto", "triton", "torch"],
                                  "reasoning_parser": list(REASONING_PARSERS),
                                  "runner": list(RUNNERS),
                                  "scheduling_policy": list(SCHEDULING_POLICIES)}
# set by the server's own flags, not as engine flags
_NOT_ENGINE_FLAGS = {"served_model_name", "model_source"}
# vLLM's other spellings of engine flags
_ALIASES = {"num_gpu_blocks": ("--num-gpu-blocks-override",),
            "tensor_parallel_size": ("-tp",)}


def check_kernel_environment() -> None:
    """The KVFLEET_* variables the kernels and layers read once at import (GEMV routing, PDL,
    decode partitions, FP8 accumulation, W4A16 tiles, layout and dequantize route), parsed
    now: a bad value is refused before the model loads."""
    from kvfleet_kernels import env, fp8, paged_attention, pdl, w4a16

    from kvfleet_runtime.layers import linear
    linear.gemv_modes(os.environ.get("KVFLEET_TRITON_GEMV", ""))
    for name in ("KVFLEET_GEMV_SILU", "KVFLEET_GEMV_PUSH", "KVFLEET_DECODE_PRELOAD",
                 "KVFLEET_W4A16_BLOCKED", "KVFLEET_V_TOKEN_MAJOR", "KVFLEET_K_HEAD_MAJOR",
                 "KVFLEET_WARM_UP_STEPS"):
        env.on_off(name, os.environ.get(name, ""))
    w4a16.gemv_overrides(os.environ.get("KVFLEET_W4A16_GEMV", ""))
    w4a16.dequant_min_m()
    w4a16.gemv_max_m()
    w4a16.tiled_overrides(os.environ.get("KVFLEET_W4A16_TILED", ""))
    from kvfleet_runtime.distributed import communication, layers
    layers.embedding_mode(os.environ.get("KVFLEET_TP_EMBEDDING", ""))
    for name in communication.SIZE_SETTINGS:
        communication.size_setting(name)
    pdl.pdl_mode(os.environ.get("KVFLEET_PDL", ""))
    paged_attention.decode_env()
    paged_attention.decode_many_programs()
    fp8.fast_accum_default()
    from kvfleet_kernels import cublaslt
    cublaslt.tune_requested()
    cublaslt.tune_rows(1)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; defaults stay EngineConfig's own (shown in --help)."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_ENGINE_FLAGS:
            continue
        kind = _scalar_type(hints[f.name])
        text = _ENGINE_HELP.get(f.name, f.name.replace("_", " "))
        if "default" not in text:
            text += f" (default: {f.default!r})"
        kwargs: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=text)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = f.name.upper()
            if f.name in _CHOICES:
                kwargs["choices"] = _CHOICES[f.name]
                kwargs.pop("metavar")
        group.add_argument("--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ()), **kwargs)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """EngineConfig from the flags that were given; ValueError names a bad field."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - _NOT_ENGINE_FLAGS
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return EngineConfig(**{**given, **overrides})


def _scalar_type(hint: Any) -> type:
    """int for `int | None`, and so on."""
    options = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return options[0]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI API",
        description=__doc__.splitlines()[0])
    parser.add_argument("model_positional", nargs="?", metavar="MODEL",
                        help="HF folder or .gguf file (same as --model)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to bind (default: 0.0.0.0)")
    server.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    server.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="names clients use in 'model'; the first labels the metrics "
                             "(default: the model's name)")
    server.add_argument("--lora-modules", nargs="+", type=_lora_module, metavar="NAME=PATH|JSON",
                        help="LoRA adapters (PEFT folders) served beside the base model, each "
                             "under its name: requests run with one by naming it as their "
                             "model. Each item is name=path, or vLLM's JSON '{\"name\": ..., "
                             "\"path\": ..., \"base_model_name\": ...}' (the served name it "
                             "adapts, listed as its parent; default: the first). Needs "
                             "--enable-lora")
    server.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, "
                             "/detokenize (default: $KVFLEET_API_KEY)")
    server.add_argument("--max-queued-requests", type=int, metavar="N",
                        help="beyond max_num_seqs + N unfinished requests answer 503 "
                             "with Retry-After (default: unbounded)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests may take to finish "
                             "(default: 30)")
    server.add_argument("--keep-alive-on-engine-death", action="store_true",
                        help="keep serving (503s) after the engine dies; by default the server "
                             "stops and exits 1, so that its pod or service manager restarts it")
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no log line per HTTP request (vLLM's flag): at thousands of "
                             "requests a second the access log is work and noise")
    server.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine in a process of its own, so that streaming to many "
                             "clients does not hold the engine's steps back on the GIL (default: "
                             "on for one GPU; off on a CPU, and with tensor parallelism until it "
                             "is measured there)")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info (vLLM's: the tokenizer's special tokens "
                             "and chat template, for clients such as lm-evaluation-harness "
                             "that then tokenize through /tokenize and /detokenize)")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name their tokens \"token_id:N\" (vLLM's; a request's "
                             "return_tokens_as_token_ids overrides it)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="completions and chat usage carry prompt_tokens_details."
                             "cached_tokens: the prompt tokens found in the prefix cache "
                             "(vLLM's; OpenAI's field)")
    server.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                        help="the chat template for /v1/chat/completions: a Jinja file, or the "
                             "template itself (default: the tokenizer's)")
    server.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="where requests' unset sampling knobs (temperature, top_p, top_k, "
                             "min_p, repetition_penalty, max_tokens) take their defaults from: "
                             "auto, the model folder's generation_config.json (as vLLM); vllm, "
                             "nowhere (the API's defaults); or another folder's (default: auto)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let requests with tools (tool_choice "auto", their default) have '
                             "the model decide to call them; needs --tool-call-parser")
    server.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="how the model writes tool calls: hermes (<tool_call> tags: "
                             "Qwen2.5, Qwen3, Hermes), llama3_json (a JSON object: Llama 3.1+), "
                             "mistral ([TOOL_CALLS] then the calls: Mistral, Mixtral) or pythonic "
                             "(a Python list of calls: Llama 3.2, Llama 4)")
    cors = parser.add_argument_group("CORS (vLLM's flags; JSON lists)")
    cors.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                      help='origins browsers may call from, e.g. \'["https://ui.example"]\'; '
                           "[] turns CORS off (default: [\"*\"])")
    cors.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                      help='(default: ["*"])')
    cors.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                      help='(default: ["*"])')
    cors.add_argument("--allow-credentials", action="store_true",
                      help="let browsers send cookies and Authorization headers cross-origin")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(parser)
    _add_vllm_args(parser)
    parser.set_defaults(func=serve)


def _add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that a copied `vllm serve` command line carries: each does here what it does
    there, or, where it cannot change anything here, takes only the value that matches what
    kvfleet does and refuses any other, naming itself."""
    vllm = parser.add_argument_group(
        "vLLM's flags", "as vLLM's where they mean something here; where they cannot change "
                        "anything, only the value that matches what kvfleet does")
    vllm.add_argument("--config", metavar="FILE.yaml",
                      help="vLLM's YAML file of flags: keys are flag names without the leading "
                           "-- (with - or _), values scalars or lists, true or false for a "
                           "switch; the command line overrides the file")
    no_code = _refused("kvfleet runs no model code from the Hub (its models are its own "
                       "code): there is no code revision to pin; drop the flag")
    vllm.add_argument("--code-revision", metavar="REV", type=no_code,
                      help="refused: kvfleet runs no model code from the Hub (its models are its "
                           "own code)")
    vllm.add_argument("--download-dir", metavar="DIR",
                      help="where models and LoRA adapters named by a Hub id, hf:// or s3:// are "
                           "pulled and cached ($KVFLEET_CACHE_DIR for this server; default: "
                           "$KVFLEET_CACHE_DIR, else ~/.cache/kvfleet); a --tokenizer Hub id "
                           "stays in transformers' cache")
    vllm.add_argument("--enable-log-requests", action="store_true",
                      help="log one line a generation request (completions, chat, responses): "
                           "its id, model, prompt tokens, max_tokens and stream, never its text")
    vllm.add_argument("--disable-log-requests", action="store_true",
                      help="accepted, changes nothing: requests are logged only with "
                           "--enable-log-requests (vLLM's deprecated flag)")
    vllm.add_argument("--disable-log-stats", action="store_true",
                      help="accepted, changes nothing: kvfleet logs no periodic engine stats "
                           "(they are on /metrics, which stays served)")
    vllm.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS,
                      help="uvicorn's log level (default: --log-level)")
    vllm.add_argument("--root-path", default="", metavar="PATH",
                      help="the path prefix a proxy serves the API under (FastAPI's root_path): "
                           "requests are answered with or without it, and the OpenAPI document "
                           "names it")
    vllm.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS: the server's key")
    vllm.add_argument("--ssl-certfile", metavar="FILE",
                      help="serve HTTPS: the server's certificate (and key, if it holds it)")
    vllm.add_argument("--ssl-ca-certs", metavar="FILE",
                      help="CA certificates clients' certificates are checked against (with "
                           "--ssl-cert-reqs 1 or 2)")
    vllm.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=0,
                      help="client certificates: 0 not asked, 1 checked if given, 2 required "
                           "(Python's ssl.CERT_*; default: 0)")
    vllm.add_argument("--disable-fastapi-docs", action="store_true",
                      help="no /docs, /redoc or /openapi.json")
    vllm.add_argument("--response-role", default="assistant", metavar="ROLE",
                      help="the role of chat completions' answers (message, first delta), "
                           "unless the request continues its final message: that message's "
                           "(default: assistant)")
    vllm.add_argument("--enable-request-id-headers", action="store_true",
                      help="every answer carries an X-Request-Id header: the request's own if "
                           "the client sent one, else a fresh id")
    vllm.add_argument("--task", type=_task, metavar="TASK",
                      help="vLLM's older spelling of --runner: generate; embed, embedding, "
                           "score, classify or reward (--runner pooling); auto")
    vllm.add_argument("--convert", choices=["auto", "none", "embed", "classify"], default="auto",
                      help="auto, none: the model as it is; embed: a causal LM serves its last "
                           "token's embeddings (--runner pooling); classify: --runner pooling "
                           "for a model that is a classifier here (a sequence-classification "
                           "checkpoint, or a config naming classifier_from_token, e.g. through "
                           "--hf-overrides); any other is refused once loaded, as no untrained "
                           "head is added (default: auto)")
    vllm.add_argument("--guided-decoding-backend", metavar="auto|xgrammar", type=_xgrammar,
                      help="only auto or xgrammar: structured outputs run on xgrammar")
    vllm.add_argument("--structured-outputs-config", metavar="JSON",
                      type=_structured_outputs_config,
                      help='only \'{"backend": "auto"}\' or \'{"backend": "xgrammar"}\': '
                           "structured outputs run on xgrammar")
    mp = _only(("mp",), "tensor-parallel workers are processes of this host")
    vllm.add_argument("--distributed-executor-backend", metavar="mp", type=mp,
                      help="only mp: tensor-parallel workers are processes of this host")
    one_stage = _only((1,), "no pipeline parallelism: shard the model with "
                            "--tensor-parallel-size", int)
    vllm.add_argument("--pipeline-parallel-size", "-pp", metavar="1", type=one_stage,
                      help="only 1: no pipeline parallelism (--tensor-parallel-size shards)")
    one_replica = _only((1,), "no data parallelism: run a server a replica; shard the model "
                              "with --tensor-parallel-size", int)
    vllm.add_argument("--data-parallel-size", "-dp", metavar="1", type=one_replica,
                      help="only 1: no data parallelism (a server a replica; "
                           "--tensor-parallel-size shards)")
    vllm.add_argument("--swap-space", type=_gib, metavar="GiB",
                      help="accepted (a number >= 0), not used: a preempted request is "
                           "recomputed, not swapped to CPU memory (as vLLM V1); logged at start")
    vllm.add_argument("--max-logprobs", type=_max_logprobs, default=MAX_LOGPROBS, metavar="N",
                      help="the most logprobs, top_logprobs or prompt_logprobs a request may ask "
                           "for (more: a 400 naming the field); at most 20, the most the engine "
                           "returns a token (default: 20)")
    vllm.add_argument("--enable-force-include-usage", action="store_true",
                      help="streamed completions and chats end with their usage chunk even "
                           "without stream_options.include_usage (answers not streamed always "
                           "carry usage)")


# uvicorn's log levels (--uvicorn-log-level)
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
# the most logprobs a token that SamplingParams takes (its logprobs and prompt_logprobs)
MAX_LOGPROBS = 20


def _only(allowed: tuple[Any, ...], why: str, kind: type = str) -> Callable[[str], Any]:
    """An argparse type for a vLLM flag that cannot change anything here: the values that match
    what kvfleet does pass, any other is refused saying why."""
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value not in allowed:
            raise argparse.ArgumentTypeError(
                f"only {' or '.join(map(str, allowed))} here ({why}); got {text!r}")
        return value
    return check


def _refused(why: str) -> Callable[[str], Any]:
    """An argparse type refusing every value of a vLLM flag that asks for what kvfleet lacks."""
    def refuse(text: str) -> Any:
        raise argparse.ArgumentTypeError(f"{why}; got {text!r}")
    return refuse


# vLLM's structured-outputs backends: only the one kvfleet's are
_xgrammar = _only(("auto", "xgrammar"), "structured outputs run on xgrammar")


def _task(text: str) -> str:
    """vLLM's --task: one of LLM's tasks (llm.py's, which imports torch: only when given)."""
    from kvfleet_runtime.llm import _TASK_RUNNERS
    if text not in _TASK_RUNNERS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(_TASK_RUNNERS)}; "
                                         f"got {text!r}")
    return text


def _structured_outputs_config(text: str) -> dict[str, str]:
    """vLLM's --structured-outputs-config: only a backend kvfleet's structured outputs are
    (xgrammar, or auto)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"backend\": "
                                         f"\"xgrammar\"}}'; got {text!r}")
    for key in value:
        if key != "backend":
            raise argparse.ArgumentTypeError(
                f"only backend may be set here; got {key!r} (a request's structured_outputs "
                "carries its own options, e.g. disable_any_whitespace)")
    _xgrammar(str(value.get("backend", "auto")))
    return value


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of GiB >= 0; got {text!r}")
    return value


def _max_logprobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [0, {MAX_LOGPROBS}] (the engine returns at most "
            f"{MAX_LOGPROBS} logprobs a token); got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]'; "
                                         f"got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules item (vLLM's): the adapter's served name, its PEFT folder and the
    served base model it adapts (None: the first served name)."""
    name: str
    path: str
    base_model_name: str | None = None


_LORA_MODULE_FORM = ('NAME=PATH or JSON \'{"name": ..., "path": ..., "base_model_name": ...}\' '
                     "(base_model_name optional)")


def _lora_module(text: str) -> LoRAModulePath:
    """--lora-modules' item, as vLLM reads it: name=path, or a JSON object."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        fields = {f.name for f in dataclasses.fields(LoRAModulePath)}
        if (isinstance(value, dict) and {"name", "path"} <= value.keys() <= fields
                and all(isinstance(value[k], str) and value[k] for k in ("name", "path"))
                and isinstance(value.get("base_model_name") or "", str)):
            return LoRAModulePath(**value)
    else:
        name, _, path = text.partition("=")
        if name and path:
            return LoRAModulePath(name, path)
    raise argparse.ArgumentTypeError(f"each item must be {_LORA_MODULE_FORM}; got {text!r}")


def lora_adapters(modules: list[LoRAModulePath], served_names: list[str] | None,
                  max_lora_rank: int) -> list[LoRAAdapter]:
    """The --lora-modules adapters (server/api.py's LoRAAdapter), ids 1, 2, ... in order.

    ValueError names the bad item: a duplicate name, a name that is a served model's, a
    base_model_name that is not one, an adapter_config.json that is missing or asks for what
    the engine cannot apply, a rank above max_lora_rank (the engine reads the weights once the
    model has loaded: _read_adapters). served_names None: not known yet (the model names
    itself when it loads); those two checks then wait.
    """
    from kvfleet_runtime.lora import LoRARequest
    from kvfleet_runtime.lora.adapter import read_config
    from kvfleet_runtime.server.api import LoRAAdapter
    adapters = []
    seen: set[str] = set()
    for i, module in enumerate(modules, start=1):
        item = f"--lora-modules {module.name!r}"
        if module.name in seen:
            raise ValueError(f"{item}: the name is given twice")
        seen.add(module.name)
        if served_names is not None:
            served = ", ".join(served_names)
            if module.name in served_names:
                raise ValueError(f"{item}: the name is a served model's ({served}); name the "
                                 "adapter otherwise")
            if module.base_model_name not in (None, *served_names):
                raise ValueError(f"{item}: base_model_name must be a served model name "
                                 f"({served}); got {module.base_model_name!r}")
        try:
            rank = read_config(module.path)["r"]
        except ValueError as e:
            raise ValueError(f"{item}: {e}") from None
        if rank > max_lora_rank:
            raise ValueError(f"{item}: rank {rank} is larger than --max-lora-rank "
                             f"({max_lora_rank})")
        parent = module.base_model_name or (served_names or [""])[0]
        adapters.append(LoRAAdapter(LoRARequest(module.name, i, module.path), parent))
    return adapters


async def _read_adapters(engine, adapters: list[LoRAAdapter]) -> None:
    """Each --lora-modules adapter read and checked by the engine before serving (vLLM
    loads them at start): one that does not fit the model fails the start, naming it."""
    for adapter in adapters:
        try:
            await engine.add_lora(adapter.request)
        except ValueError as e:
            raise ValueError(f"--lora-modules {adapter.name!r}: {e}") from None


def load_chat_template(value: str) -> str:
    """--chat-template's value: a file's text, or the template itself (as vLLM reads it);
    ValueError when it is neither a file nor a template, or does not compile."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{" in value or "\n" in value:
        template = value
    else:
        raise ValueError(f"--chat-template: no file {value!r} (and it is not a Jinja template)")
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template
    try:       # compiled as transformers will render it (its extensions: {% generation %}, ...)
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {e.lineno}: "
                         f"{e.message})") from None
    return template


def serve(args: argparse.Namespace) -> int:
    import uvicorn
    from prometheus_client import CollectorRegistry, disable_created_metrics

    from kvfleet_runtime.engine.async_engine import AsyncLLMEngine
    from kvfleet_runtime.engine.engine_process import EngineProcess
    from kvfleet_runtime.engine.gc_tuning import gc_threshold, tune_gc
    from kvfleet_runtime.generation_config import load_sampling_defaults
    from kvfleet_runtime.server.api import (
        CORS,
        APIOptions,
        build_app,
        runtime_lora_updating_allowed,
    )
    from kvfleet_runtime.server.metrics import EngineMetrics, add_process_metrics

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        print("kvfleet serve: error: --max-queued-requests must be >= 0; "
              f"got {args.max_queued_requests}", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("kvfleet serve: error: --enable-auto-tool-choice needs --tool-call-parser "
              f"({' or '.join(TOOL_CALL_PARSERS)})", file=sys.stderr)
        return 2
    if args.swap_space is not None:
        logger.info("--swap-space %g GiB: not used; a preempted request is recomputed, not "
                    "swapped to CPU memory (as vLLM V1)", args.swap_space)
    names = args.served_model_name or []
    overrides: dict[str, Any] = {}
    if args.model_positional:
        overrides["model"] = args.model_positional
    if names:
        overrides["served_model_name"] = names[0]
    try:
        check_vllm_args(args)
        if args.download_dir is not None:      # the cache of every pull below, and of adapters
            os.environ["KVFLEET_CACHE_DIR"] = os.path.abspath(os.path.expanduser(
                args.download_dir))
        chat_template = (None if args.chat_template is None
                         else load_chat_template(args.chat_template))
        config = engine_config_from_args(args, **overrides)
        lora_modules = args.lora_modules or []
        if lora_modules and not config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        # a Hub id, hf:// or s3:// adapter or model: pulled into the cache now (model_source)
        given = {m.name: m.path for m in lora_modules}      # (/v1/models shows them)
        lora_modules = [dataclasses.replace(m, path=resolve(m.path)[0]) for m in lora_modules]
        # refused before loading where it can
        lora_adapters(lora_modules, names or None, config.max_lora_rank)
        resolve_config(config)
        sampling_defaults = load_sampling_defaults(args.generation_config, config.model)
        gc_threshold(os.environ.get("KVFLEET_GC_THRESHOLD", ""))      # refused before loading
        check_kernel_environment()
        engine_process = args.engine_process
        if engine_process is None:      # one GPU: vLLM's engine core runs in a process too
            engine_process = config.device.startswith("cuda") and config.tensor_parallel_size == 1
    except ValueError as e:
        print(f"kvfleet serve: error: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    engine = AsyncLLMEngine(config, max_queued_requests=args.max_queued_requests,
                            engine_process=engine_process)
    names = names or [engine.served_model_name]
    try:        # again, now that the model has named itself; then their weights are read
        adapters = [dataclasses.replace(a, root=given[a.name])
                    for a in lora_adapters(lora_modules, names, config.max_lora_rank)]
        if adapters:
            asyncio.run(_read_adapters(engine, adapters))
        if args.convert == "classify":
            check_classifier(engine.pooler)
    except ValueError as e:
        print(f"kvfleet serve: error: {e}", file=sys.stderr)
        asyncio.run(engine.shutdown())
        return 2
    # the *_created series would double every scrape, and nothing queries them
    disable_created_metrics()
    registry = CollectorRegistry()
    # set before the first request: the loop thread only reads it when requests come
    engine.stat_logger = EngineMetrics(names[0], registry)
    child = engine.engine.process if isinstance(engine.engine, EngineProcess) else None
    add_process_metrics(registry, names[0], None if child is None else lambda: child.pid)
    logger.info("loaded %s as %s in %.1f s (max_model_len %d)", config.model, names[0],
                time.monotonic() - start, engine.config.max_model_len)
    cors = CORS(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                args.allow_credentials)
    runtime_lora = runtime_lora_updating_allowed(os.environ)
    if runtime_lora and not config.enable_lora:
        logger.warning("runtime LoRA updating is allowed by the environment but --enable-lora "
                       "is off: /v1/load_lora_adapter is not served")
    app = build_app(engine, served_model_names=names, lora_adapters=adapters,
                    runtime_lora_updating=runtime_lora and config.enable_lora,
                    api_key=args.api_key, registry=registry, chat_template=chat_template,
                    cors=cors, sampling_defaults=sampling_defaults,
                    tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice
                    else None, reasoning_parser=config.reasoning_parser,
                    tokenizer_info=args.enable_tokenizer_info_endpoint,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    options=APIOptions(
                        response_role=args.response_role, max_logprobs=args.max_logprobs,
                        force_include_usage=args.enable_force_include_usage,
                        log_requests=args.enable_log_requests,
                        request_id_headers=args.enable_request_id_headers,
                        docs=not args.disable_fastapi_docs, root_path=args.root_path))
    if sampling_defaults:
        logger.info("requests' unset sampling knobs default to the model's generation config: "
                    "%s (--generation-config vllm: the API's defaults)", sampling_defaults)
    server = uvicorn.Server(uvicorn_config(app, args))
    # uvicorn drains on SIGTERM, then re-raises the signal to the handler it found:
    # a no-op one lets the drained process exit 0 instead of dying by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    died = threading.Event()
    if not args.keep_alive_on_engine_death:
        threading.Thread(target=_stop_on_engine_death, args=(engine, server, died),
                         name="kvfleet-engine-watch", daemon=True).start()
    tune_gc()       # start-up's objects collected; fewer collections per engine step
    server.run()
    if died.is_set():
        _exit_dead(engine)
    return 0


def check_vllm_args(args: argparse.Namespace) -> None:
    """vLLM's flags that only make sense together, refused before any model loads (ValueError
    naming them); --task and --convert set args.runner, as --runner would."""
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')}: no file {path!r}")
    if (args.ssl_keyfile or args.ssl_ca_certs or args.ssl_cert_reqs) and not args.ssl_certfile:
        raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile "
                         "(the server's certificate)")
    asked = {}      # flag as given -> the runner it asks for
    if hasattr(args, "runner"):
        asked[f"--runner {args.runner}"] = args.runner
    if args.task is not None:
        from kvfleet_runtime.llm import _TASK_RUNNERS
        asked[f"--task {args.task}"] = _TASK_RUNNERS[args.task]
    if args.convert in ("embed", "classify"):
        asked[f"--convert {args.convert}"] = "pooling"
    runners = {runner for runner in asked.values() if runner != "auto"}
    if len(runners) > 1:
        raise ValueError(f"{' and '.join(asked)} ask for different runners "
                         f"({', '.join(sorted(runners))})")
    if runners:
        args.runner = runners.pop()


def check_classifier(pooler) -> None:
    """--convert classify: the model must be a classifier here (its PoolerConfig has labels);
    kvfleet adds no untrained classification head to a causal LM."""
    if not pooler.num_labels:
        raise ValueError("--convert classify: this model is not a classifier here (a "
                         "sequence-classification checkpoint, or a config naming "
                         "classifier_from_token, e.g. through --hf-overrides); no untrained "
                         "head is added" + (f": {pooler.classifier_refused}"
                                            if pooler.classifier_refused else ""))


def uvicorn_config(app, args: argparse.Namespace):
    """uvicorn's Config of the server's flags (host, port, log level, access log, graceful
    shutdown, TLS)."""
    import uvicorn
    return uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=max(1, round(args.shutdown_timeout)),
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


ENGINE_WATCH_S = 0.2     # how often the server looks at the engine's health
DEAD_EXIT_S = 3.0        # how long a server whose engine died may take to stop
WORKER_KILL_WAIT_S = 5.0  # then how long it waits for killed tensor-parallel workers to exit


def _exit_dead(engine) -> None:
    """Exit 1 without interpreter teardown: a dead engine's loop thread may be stuck in a GPU
    call whose peer died, and CUDA/NCCL exit handlers would wait on it. No worker is left."""
    engine.kill_workers(WORKER_KILL_WAIT_S)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _stop_on_engine_death(engine, server, died: threading.Event) -> None:
    """Stop uvicorn once the engine has died (a CUDA error, a dead or hung tensor-parallel
    worker): in-flight requests have had their errors, and a process that can only answer 503
    is better restarted now than after the liveness probe's failures. If the shutdown has not
    ended the process DEAD_EXIT_S later, this thread ends it."""
    while not server.should_exit:
        reason = engine.death_reason
        if reason is not None and not server.should_exit:     # not a shutdown under way
            logger.error("the engine has died (%s); the server stops and exits 1", reason)
            died.set()
            engine.fail_requests_if_dead()     # in flight: their errors now, not at the drain's end
            server.should_exit = True
            # uvicorn's shutdown then the engine's: on GPUs that can wait on a loop stuck for
            # good in a collective with a dead peer, and on NCCL's teardown (10 s each)
            time.sleep(DEAD_EXIT_S)
            logger.error("the server did not stop within %.0f s of its engine's death; "
                         "it exits now", DEAD_EXIT_S)
            _exit_dead(engine)
        time.sleep(ENGINE_WATCH_S)
