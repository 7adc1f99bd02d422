"""Request: one sequence's tokens, its progress (num_computed_tokens), status and sampling state."""

from __future__ import annotations

import enum
import itertools
import time

import torch

from kvfleet_runtime.outputs import Logprob, PositionLogprobs, RequestMetrics
from kvfleet_runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


# a tuple: `in` compares by identity first (a set would call Enum's Python-level __hash__)
FINISHED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                     RequestStatus.FINISHED_ABORTED)


_ARRIVALS = itertools.count()


class Request:
    """A single sequence. n > 1 fans out into n Requests sharing `group_id`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, group_id: str | None = None,
                 index: int = 0, lora_request=None, priority: int = 0) -> None:
        self.request_id = request_id
        # the priority scheduling policy's order: lower first; ties by arrival, then creation
        self.priority = priority
        self.arrival_seq = next(_ARRIVALS)
        self.group_id = group_id or request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # async scheduling: tokens sampled by a step still on the device, not yet appended
        self.num_pending = 0
        self.num_cached_tokens = -1          # prefix-cache hit of the first schedule; -1: not yet
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []    # hash chain of this request's full blocks
        self.lora_request = lora_request     # its LoRA adapter (kvfleet_runtime.lora), or None
        # the hash chain starts from the adapter (its KV differs from the base model's) and the
        # request's cache_salt (vLLM's: only requests of the same salt share cached blocks)
        self.cache_salt = None if lora_request is None else ("lora", lora_request.lora_int_id)
        if params.cache_salt is not None:
            self.cache_salt = (self.cache_salt, "salt", params.cache_salt)
        self.sibling: Request | None = None  # n > 1: wait until this one's prompt is cached
        self.generator: torch.Generator | None = None   # seeded per request by the engine
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self.detokenizer = None              # set by the engine
        self.grammar = None                  # structured outputs: its SequenceGrammar
        self.embedding: list[float] | None = None   # a pooling request's, once computed
        self.spec_token_ids: list[int] = []  # speculative decoding: drafts for the next step
        self.token_bytes = bytearray()       # ... and all_token_ids as int32 bytes (the lookup)
        # sampling reads this request's generated tokens (penalties, min_tokens)
        self.needs_history = params.needs_penalties or bool(params.min_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finishes_with_pending(self) -> bool:
        """The pending token reaches max_tokens: no step after it is needed."""
        return (self.num_pending > 0
                and len(self.output_token_ids) + self.num_pending >= self.params.max_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def add_logprobs(self, position: dict[int, Logprob], chosen_logprob: float) -> None:
        self.cumulative_logprob += chosen_logprob
        self.logprobs.append(position)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
