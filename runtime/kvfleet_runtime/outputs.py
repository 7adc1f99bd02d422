"""What the engine hands back: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely
    decoded_token: str | None = None


# one position: token id -> Logprob (the chosen token plus the top-k)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str                                   # cumulative
    token_ids: list[int]                        # cumulative
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None            # "stop" | "length" | "abort"
    stop_reason: int | str | None = None        # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None      # a pooling request's (kvfleet_runtime/pooling.py)


@dataclass
class EngineStats:
    """A snapshot for /metrics; the *_total fields are cumulative counters."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries_total: int = 0   # tokens looked up
    prefix_cache_hits_total: int = 0      # tokens found
    num_preemptions_total: int = 0
    extra: dict = field(default_factory=dict)
    # LoRA engines: (max_loras, the running requests' adapters, the waiting ones'), names
    # comma-joined and sorted (vLLM's lora_requests_info labels); None without LoRA
    lora: tuple[int, str, str] | None = None
