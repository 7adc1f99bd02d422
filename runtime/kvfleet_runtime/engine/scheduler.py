"""Scheduler: one rule — each running request's num_computed_tokens catches up with its tokens
inside a token budget.

Decode (1 new token), chunked prefill (a slice of the prompt) and prefix-cache
skips (num_computed_tokens starts past the cached blocks) all fall out of it.
Running requests go first, in admission order; then waiting ones, FCFS. When
blocks run out the most recently admitted running request is preempted by
recompute: its blocks are freed (full ones stay in the prefix cache) and it
goes back to the front of the queue.

The priority policy (vLLM's `--scheduling-policy priority`): waiting requests are admitted
by (priority, arrival), lower values first, and the running request preempted when blocks run
out is the one latest in that order (even if it was scheduled earlier in the step: it gives
its tokens back). A request of higher priority does not evict running ones to be admitted.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvfleet_runtime.config import SCHEDULING_POLICIES
from kvfleet_runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet_runtime.request import Request, RequestStatus


class ScheduledRequest:
    """One request's share of a step. `samples`: whether the step reaches the request's last
    token, so a new token is sampled; fixed when scheduled (the engine reads it several times
    a step, for every row, and the request's counters move once the step is launched).
    `spec_token_ids`: speculative decoding's drafts computed after the last token (counted in
    num_new_tokens)."""

    __slots__ = ("request", "num_new_tokens", "samples", "spec_token_ids")

    def __init__(self, request: Request, num_new_tokens: int,
                 spec_token_ids: list[int] | tuple = ()) -> None:
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.spec_token_ids = spec_token_ids
        self.samples = (request.num_computed_tokens + num_new_tokens
                        == len(request.all_token_ids) + request.num_pending + len(spec_token_ids))

    def __repr__(self) -> str:
        return f"ScheduledRequest({self.request!r}, num_new_tokens={self.num_new_tokens})"


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def priority_order(request: Request) -> tuple[int, float, int]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return (request.priority, request.metrics.arrival_time, request.arrival_seq)


class PriorityQueue:
    """The waiting requests of the priority policy, in priority_order: a heap with the deque
    operations the scheduler uses (a request put back, preempted or skipped, takes its place
    by its order, not the front)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_order(request), request))

    appendleft = append

    def extendleft(self, requests) -> None:
        for r in requests:
            self.append(r)

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("a priority queue gives only its first request")
        return self._heap[0][-1]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("request is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        # heap order, not priority_order: the stats walk the queue every step and need no order
        return (entry[-1] for entry in self._heap)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, admission_headroom: int = 0,
                 policy: str = "fcfs", long_prefill_token_threshold: int = 0) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {policy!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        # tokens of growth per running request (up to its max_tokens) that must still fit in
        # the free blocks after a new request is admitted; 0 = admit while blocks remain
        self.admission_headroom = admission_headroom
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # vLLM's: a prompt's chunk in one step is at most this many tokens (0: the budget's),
        # so that one long prompt does not take a whole step from the others' prefills
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = policy
        self.waiting: deque[Request] | PriorityQueue = (
            PriorityQueue() if policy == "priority" else deque())
        self.running: list[Request] = []
        self.num_preemptions = 0
        # speculative decoding: running requests may carry drafts (Request.spec_token_ids)
        self.speculative = False
        # LoRA: most distinct adapters among the running requests (None: LoRA is off)
        self.max_loras: int | None = None

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = self.running
        scheduled = out.scheduled
        allocate = self.kv.allocate_slots
        speculative = self.speculative
        threshold = self.long_prefill_token_threshold      # (0: prompts chunked by the budget)
        i = 0
        # this loop runs for every running request every step: attributes read directly
        while i < len(running) and budget > 0:
            request = running[i]
            i += 1
            pending = request.num_pending
            # a token still being sampled on the device (async scheduling) is this step's input
            num_new = len(request.all_token_ids) + pending - request.num_computed_tokens
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0 or (pending and len(request.output_token_ids) + pending
                                >= request.params.max_tokens):
                continue        # its last token is on its way: nothing left to compute
            if speculative and request.spec_token_ids and num_new == 1 and budget > 1:
                drafts = request.spec_token_ids[:budget - 1]
                # the drafts only where blocks are free for them: nobody is preempted for them
                if allocate(request, 1 + len(drafts)) is not None:
                    scheduled.append(ScheduledRequest(request, 1 + len(drafts), drafts))
                    budget -= 1 + len(drafts)
                    continue
            if allocate(request, num_new) is None:   # (a failed allocation changes nothing)
                returned = self._allocate_or_preempt(request, num_new, out)
                if returned is None:
                    break   # the request preempted itself: nothing below it runs either
                if self.policy == "priority":   # victims ahead of it may have left the list
                    budget += returned
                    i = running.index(request) + 1
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             out: SchedulerOutput) -> int | None:
        """Preempt running requests until `request` gets its slots: None if it preempted
        itself, else the tokens the victims already scheduled this step gave back (only the
        priority policy picks those)."""
        returned = 0
        while self.kv.allocate_slots(request, num_new) is None:
            if self.policy == "priority":
                victim = max(self.running, key=priority_order)
                self.running.remove(victim)
                for j, s in enumerate(out.scheduled):
                    if s.request is victim:
                        returned += s.num_new_tokens
                        del out.scheduled[j]
                        break
            else:
                victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return None
        return returned

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _growth_blocks(self, request: Request) -> int:
        """Blocks `request` needs beyond those it holds to grow by the headroom (its remaining
        prompt included, its max_tokens at most)."""
        r = request
        remaining = r.params.max_tokens - len(r.output_token_ids) - r.num_pending
        target = r.num_tokens + r.num_pending + max(min(self.admission_headroom, remaining), 0)
        return max(self.kv.num_blocks_for(target) - len(self.kv.get_block_ids(r.request_id)), 0)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        reserve = 0
        if self.admission_headroom and self.waiting and len(self.running) < self.max_num_seqs:
            # the running requests' next admission_headroom tokens stay allocatable: admitting
            # into that room only leads to preempting (and recomputing) someone later
            reserve = sum(self._growth_blocks(r) for r in self.running)
        adapters = (None if self.max_loras is None else
                    {r.lora_request.lora_int_id for r in self.running if r.lora_request})
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:
                break   # preempted while its last token was on the device: wait for it
            if (adapters is not None and request.lora_request is not None
                    and request.lora_request.lora_int_id not in adapters
                    and len(adapters) >= self.max_loras):
                # its adapter would be one too many this step: later requests may go first
                skipped.append(self.waiting.popleft())
                continue
            if request.sibling is not None and not self._sibling_prompt_cached(request):
                # n > 1: let the first sample compute the prompt, the others then hit the cache
                skipped.append(self.waiting.popleft())
                continue
            computed, num_computed = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if 0 < self.long_prefill_token_threshold < num_new:
                num_new = self.long_prefill_token_threshold
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, computed, reserve) is None:
                break
            if self.admission_headroom:
                reserve += self._growth_blocks(request)
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()   # ends queue time
            request.status = RequestStatus.RUNNING
            if adapters is not None and request.lora_request is not None:
                adapters.add(request.lora_request.lora_int_id)
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    @staticmethod
    def _sibling_prompt_cached(request: Request) -> bool:
        sib = request.sibling
        return sib.is_finished or sib.num_computed_tokens >= sib.num_prompt_tokens

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out (finished or aborted) and free its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request)
