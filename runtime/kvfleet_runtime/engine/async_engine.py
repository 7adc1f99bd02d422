"""AsyncLLMEngine: the asyncio front of LLMEngine.

LLMEngine is not thread-safe, so one background thread owns it and runs the
step loop. Coroutines never touch it: `generate()` and `abort()` put commands
on a thread-safe queue that the loop thread applies between steps, and the
loop thread hands each step's outputs to per-request asyncio queues with
`loop.call_soon_threadsafe`. A consumer that stops iterating (a client that
disconnected, a cancelled task) aborts its request, which frees its blocks.

With engine_process=True the LLMEngine runs in a child process instead (engine_process.py):
commands go down its pipe, and the loop thread only reads the child's step messages and
delivers them the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvfleet_runtime.beam_search import BeamSearch, BeamSearchParams
from kvfleet_runtime.config import EngineConfig, check_priority
from kvfleet_runtime.engine.engine_process import EngineProcess, OutputMerger
from kvfleet_runtime.lora import LoRARequest
from kvfleet_runtime.outputs import CompletionOutput, EngineStats, RequestOutput
from kvfleet_runtime.pooling import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    embedding_sampling_params,
)
from kvfleet_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# how long the idle loop sleeps before re-checking for shutdown
_IDLE_WAIT_S = 0.5
DEAD_JOIN_S = 10.0      # how long shutdown waits for a dead engine's loop thread


class EngineDeadError(RuntimeError):
    """The step loop has died; no request can be served any more."""


class EngineQueueFullError(RuntimeError):
    """Admitting the request would exceed max_num_seqs + max_queued_requests."""


class StatLogger(Protocol):
    """Observes the loop thread (metrics). Called from the loop thread only."""

    def record_step(self, stats: EngineStats, outputs: list[RequestOutput], now: float) -> None: ...

    def record_aborted(self, request_ids: list[str], now: float) -> None: ...


@dataclass
class _Stream:
    """Where the loop thread delivers one request's outputs."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest | None = None
    priority: int = 0


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _AddLoRA:
    """Read an adapter now; `done` gets None or the error (set on `loop`)."""
    lora_request: LoRARequest
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


class _Aborted:
    """Queue item: the request was aborted before it finished."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, *, max_queued_requests: int | None = None,
                 stat_logger: StatLogger | None = None, engine_process: bool = False) -> None:
        """engine_process: run the LLMEngine in a child process (engine_process.py) instead of
        a thread of this one; the loop thread then only reads its steps' outputs."""
        from kvfleet_runtime.model_source import resolve_config
        resolve_config(config)      # pulled here, once, before the engine process starts
        self._lora_folders: dict[str, str] = {}     # remote adapter path -> its pulled folder
        self._merger: OutputMerger | None = None
        if engine_process:
            self.engine = EngineProcess(config)
            self._merger = OutputMerger(self.engine.tokenizer, self.engine.eos_token_ids)
        else:
            from kvfleet_runtime.engine.engine import LLMEngine  # torch-heavy; imported on use
            self.engine = LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.pooler = self.engine.pooler        # how the model embeds and scores
        self.served_model_name: str = self.engine.served_model_name
        self.max_queued_requests = max_queued_requests
        self.stat_logger = stat_logger
        self._commands: queue.SimpleQueue[_Add | _Abort | _AddLoRA | None] = queue.SimpleQueue()
        # engine process: add_lora calls waiting for the child's answer, by adapter id
        self._lora_waiters: dict[int, list[_AddLoRA]] = {}
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}     # touched under _lock from both sides
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run_loop if self._merger is None else self._run_reader,
            name="kvfleet-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> AsyncLLMEngine:
        return cls(config, **kwargs)

    # ---- asyncio side ----

    @property
    def is_healthy(self) -> bool:
        return self.death_reason is None

    @property
    def death_reason(self) -> str | None:
        """Why the engine serves no more requests, or None while it does: the exception that
        ended its loop, or a dead tensor-parallel worker (seen here before the next step trips
        on it), or a loop that stopped (shutdown)."""
        if self._dead is not None:
            return repr(self._dead)
        reason = self.engine.death_reason()
        if reason is None and not self._thread.is_alive():
            reason = "the engine loop has stopped"
        return reason

    def check_health(self) -> None:
        reason = self.death_reason
        if reason is not None:
            raise EngineDeadError(f"the engine has died: {reason}")

    def get_stats(self) -> EngineStats:
        """The snapshot taken after the loop's last step, add or abort."""
        return self._stats

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until the request finishes (with the LoRA adapter
        lora_request, where the engine has enable_lora; priority: its place under the priority
        scheduling policy, lower first; ValueError for any other than 0 under fcfs).

        Outputs that pile up while the consumer is busy are coalesced (they are
        cumulative, so only the latest matters). Leaving the loop early, or
        being cancelled, aborts the request.
        """
        request_id = request_id or uuid.uuid4().hex
        check_priority(priority, self.config.scheduling_policy)
        lora_request = await self._local_lora(lora_request)
        stream = self._add(request_id, prompt, params, lora_request, priority)
        last: RequestOutput | None = None
        try:
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty() and not _is_final(item):
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Aborted):
                    last = _aborted_output(request_id, prompt, params, last)
                    yield last
                    return
                last = item
                yield item
                if item.finished:
                    return
        finally:
            if last is None or not last.finished:
                self._submit(_Abort([request_id]))

    async def encode(self, prompt: str | list[int], pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, lora_request: LoRARequest | None = None,
                     priority: int = 0) -> AsyncIterator[EmbeddingRequestOutput]:
        """vLLM's encode: the prompt's embedding (kvfleet_runtime/pooling.py), yielded once, when
        the step that ends its prompt has run; batched with the generation requests. A bad
        request raises ValueError (as generate does); an aborted one RuntimeError."""
        params = embedding_sampling_params(pooling_params or PoolingParams())
        async for out in self.generate(prompt, params, request_id, lora_request, priority):
            if out.finished:
                if out.embedding is None:
                    raise RuntimeError(f"embedding request {out.request_id} was aborted")
                yield EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.embedding),
                                             out.prompt_token_ids)

    async def beam_search(self, prompt: str | list[int], request_id: str,
                          params: BeamSearchParams, lora_request: LoRARequest | None = None,
                          priority: int = 0, skip_special_tokens: bool = True
                          ) -> AsyncIterator[RequestOutput]:
        """vLLM's beam search (kvfleet_runtime/beam_search.py): yields one finished
        RequestOutput whose beam_width samples are the best beams, best first (each its
        generated tokens and their text). Each round's beams run as requests
        "{request_id}-{round}-{beam}" beside every other request; leaving early, or being
        cancelled, aborts them. ValueError for a prompt + max_tokens past max_model_len."""
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        max_len = self.config.max_model_len
        if max_len is not None and len(ids) + params.max_tokens > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Reduce the prompt or max_tokens.")
        search = BeamSearch(ids, params, set(self.engine.eos_token_ids))

        async def extend(tokens: list[int], rid: str) -> RequestOutput:
            async for out in self.generate(tokens, search.sampling_params, rid, lora_request,
                                           priority):
                if out.finished and out.outputs[0].finish_reason != "abort":
                    return out
            raise RuntimeError(f"beam search request {rid} was aborted")

        while not search.done:
            tasks = [asyncio.ensure_future(extend(tokens, f"{request_id}-{search.rounds}-{i}"))
                     for i, tokens in enumerate(search.requests())]
            try:
                outs = await asyncio.gather(*tasks)
            finally:
                for task in tasks:      # (one failed, or this was cancelled: abort the others)
                    task.cancel()
            search.advance(outs)
        yield search.request_output(request_id, prompt if isinstance(prompt, str) else None,
                                    self.tokenizer, skip_special_tokens)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check a LoRA adapter now, before any request names it (vLLM's add_lora:
        the server does so for --lora-modules at start); a ValueError says why it cannot
        serve. It then stays in host memory (up to max_cpu_loras adapters)."""
        self.check_health()
        lora_request = await self._local_lora(lora_request)
        loop = asyncio.get_running_loop()
        command = _AddLoRA(lora_request, loop, loop.create_future())
        if self._merger is not None:
            with self._lock:
                self._lora_waiters.setdefault(lora_request.lora_int_id, []).append(command)
            self.engine.send(("add_lora", lora_request))
        else:
            self._commands.put(command)
            self._wakeup.set()
        error = await command.done
        if error is not None:
            raise error

    async def _local_lora(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """An adapter named by a Hub id, hf:// or s3:// path: pulled (once, in a worker thread:
        neither this loop nor the engine waits on the download) and named by its folder."""
        if lora_request is None:
            return None
        from kvfleet_runtime.model_source import local_lora, remote_source
        if remote_source(lora_request.lora_path) is None:
            return lora_request
        return await asyncio.to_thread(local_lora, lora_request, self._lora_folders)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._submit(_Abort(ids))

    async def shutdown(self) -> None:
        """Stop the loop thread; unfinished requests end as aborted. A dead engine's loop gets
        DEAD_JOIN_S to stop: it may be stuck for good (a rank spinning in a collective with a
        dead peer), and the workers are stopped regardless."""
        self._stopping = True
        self._commands.put(None)
        self._wakeup.set()
        timeout = None if self.is_healthy else DEAD_JOIN_S
        loop = asyncio.get_running_loop()
        if self._merger is not None:     # the process stops first, then the thread reading it
            await loop.run_in_executor(None, self.engine.shutdown)
        await loop.run_in_executor(None, self._thread.join, timeout)
        self.engine.shutdown()

    def kill_workers(self, wait_s: float) -> None:
        """SIGKILL the tensor-parallel workers, if any (a process about to exit without its
        shutdown must not leave them behind); waits up to wait_s for them to exit."""
        self.engine.kill_workers(wait_s)

    def fail_requests_if_dead(self) -> None:
        """End every unfinished request with EngineDeadError now if the engine has died. Its
        loop does so itself when a step raises; this serves when the loop cannot (stuck on a
        GPU step whose peer died)."""
        try:
            self.check_health()
        except EngineDeadError as e:
            self._fail_all(e)

    def check_admission(self, num_requests: int = 1) -> None:
        """Raise unless num_requests more requests may be admitted now."""
        self.check_health()
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if self.max_queued_requests is None:
            return
        capacity = self.config.max_num_seqs + self.max_queued_requests
        if len(self._streams) + num_requests > capacity:
            raise EngineQueueFullError(
                f"the server is at capacity ({self.config.max_num_seqs} running + "
                f"{self.max_queued_requests} queued requests); retry later")

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
             lora_request: LoRARequest | None = None, priority: int = 0) -> _Stream:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self.check_admission()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._submit(_Add(request_id, prompt, params, time.monotonic(), lora_request, priority))
        return stream

    def _submit(self, command: _Add | _Abort) -> None:
        if self._merger is not None:
            # straight to the engine process, which confirms aborts: the loop thread then ends
            # their streams, as it does every other change to them
            if isinstance(command, _Add):
                self._merger.expect(command.request_id, command.params)
            self.engine.send(("add", command.request_id, command.prompt, command.params,
                              command.arrival_time, command.lora_request, command.priority)
                             if isinstance(command, _Add)
                             else ("abort", command.request_ids))
            return
        self._commands.put(command)
        self._wakeup.set()

    # ---- loop thread ----

    def _run_loop(self) -> None:
        try:
            while not self._apply_commands():
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._publish(outputs)
        except BaseException as e:      # noqa: BLE001 - any death must reach the clients
            logger.exception("engine loop died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine loop has died: {e!r}"))
            return
        self._abort_all()

    def _run_reader(self) -> None:
        """engine_process: each step's outputs from the child, to their streams."""
        try:
            while not self._stopping:
                message = self.engine.recv()
                steps = []      # every step already waiting: delivered as one
                while message[0] == "step":
                    steps.append(message)
                    if not self.engine.pending():
                        break
                    message = self.engine.recv()
                if steps:
                    self._publish(self._merger.merge([step[1] for step in steps]), steps[-1][2])
                kind = message[0]
                if kind == "step":
                    continue
                if kind == "rejected":
                    self._merger.forget([message[1]])
                    self._deliver([(self._pop_stream(message[1]), message[2])])
                elif kind == "lora":        # an adapter read (error None) or refused
                    with self._lock:
                        command = self._lora_waiters[message[1]].pop(0)
                    command.loop.call_soon_threadsafe(command.done.set_result, message[2])
                elif kind == "commands":       # applied: the aborted ones, the stats after
                    self._merger.forget(message[1])
                    self._apply_abort(message[1])
                    self._publish([], message[2])
                elif not self._stopping:    # "dead"
                    raise EngineDeadError(message[1])
                else:
                    break
        except BaseException as e:      # noqa: BLE001 - any death must reach the clients
            logger.error("engine process died: %s", e)
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine has died: {e}"))
            return
        self._abort_all()

    def _apply_commands(self) -> bool:
        """Apply queued adds and aborts; True when shutdown was requested."""
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is None:
                return True
            changed = True
            if isinstance(command, _Add):
                self._apply_add(command)
            elif isinstance(command, _AddLoRA):
                try:
                    self.engine.add_lora(command.lora_request)
                    error = None
                except (ValueError, TypeError) as e:
                    error = e
                command.loop.call_soon_threadsafe(command.done.set_result, error)
            else:
                self._apply_abort(command.request_ids)
        if changed:
            self._publish([])
        return False

    def _apply_add(self, command: _Add) -> None:
        with self._lock:
            stream = self._streams.get(command.request_id)
        if stream is None:          # aborted before it reached the loop
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    arrival_time=command.arrival_time,
                                    lora_request=command.lora_request,
                                    priority=command.priority)
        except (ValueError, TypeError) as e:
            self._deliver([(self._pop_stream(command.request_id), e)])

    def _apply_abort(self, request_ids: list[str]) -> None:
        """Abort the requests still running and end their streams."""
        streams = {rid: stream for rid in request_ids
                   if (stream := self._pop_stream(rid)) is not None}
        if streams:
            if self._merger is None:      # (the engine process aborted them already)
                self.engine.abort_request(list(streams))
            if self.stat_logger is not None:
                self.stat_logger.record_aborted(list(streams), time.monotonic())
            self._deliver([(stream, _Aborted()) for stream in streams.values()])

    def _pop_stream(self, request_id: str) -> _Stream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _publish(self, outputs: list[RequestOutput], stats: EngineStats | None = None) -> None:
        now = time.monotonic()
        self._stats = stats if stats is not None else self.engine.get_stats()
        if self.stat_logger is not None:
            self.stat_logger.record_step(self._stats, outputs, now)
        deliveries: list[tuple[_Stream | None, object]] = []
        for out in outputs:
            with self._lock:
                stream = (self._streams.pop(out.request_id, None) if out.finished
                          else self._streams.get(out.request_id))
            deliveries.append((stream, out))     # the engine built it for this step alone
        self._deliver(deliveries)

    @staticmethod
    def _deliver(deliveries: list[tuple[_Stream | None, object]]) -> None:
        # one wake-up per event loop per step, not one per request
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for stream, item in deliveries:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:    # that loop is closed: nobody is listening
                pass

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            waiters = [w for ws in self._lora_waiters.values() for w in ws]
            self._lora_waiters = {}
        self._deliver([(s, error) for s in streams])
        for w in waiters:
            w.loop.call_soon_threadsafe(w.done.set_result, error)

    def _abort_all(self) -> None:
        with self._lock:
            request_ids = list(self._streams)
        self._apply_abort(request_ids)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _is_final(item: object) -> bool:
    return not isinstance(item, RequestOutput) or item.finished


def _aborted_output(request_id: str, prompt: str | list[int], params: SamplingParams,
                    last: RequestOutput | None) -> RequestOutput:
    if last is None:
        return RequestOutput(
            request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
            outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                     for i in range(params.n)], finished=True)
    return dataclasses.replace(last, finished=True, outputs=[
        c if c.finished else dataclasses.replace(c, finish_reason="abort") for c in last.outputs])
