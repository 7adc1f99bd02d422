"""The LLMEngine in a process of its own, for AsyncLLMEngine(engine_process=True) (`kvfleet serve
--engine-process`).

In one process the engine's loop thread and the server's event loop share the GIL: streaming a
token to ~1000 clients a step is Python work on the event loop, and every time the loop thread
lets go of the GIL (each wait on the GPU) it may wait for it to come back while the next step
should already be launching. With the engine in a child process each side has a GIL of its
own; the server's side lags by coalescing tokens into fewer stream chunks, and the engine
steps at its own pace (vLLM's engine core process does the same for the same reason).

The pipe carries commands down (add, abort, None to stop) and, up, one message a step: each
output as a delta (its new token ids and logprobs, its text's new end, the prompt's fields
once; DeltaEngine builds them) and the engine's stats, pickled by the engine's thread and
written by another, so the engine never waits on the pipe. `OutputMerger` turns the deltas
back into the cumulative RequestOutputs the in-process engine gives, field for field; a parent
that fell behind merges the steps waiting for it into one output a request.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Iterable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.detokenizer import IncrementalDetokenizer, stop_token_unshown
from kvfleet_runtime.engine.delta_engine import SHORT_DELTA_LEN, server_detokenizes
from kvfleet_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvfleet_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5          # an idle engine process waits this long for a command at a time
READY_TIMEOUT_S = 3600.0    # loading a large checkpoint can take long; a dead child ends it sooner
_SENDER_JOIN_S = 10.0       # how long a stopping engine process waits for its last messages to go
_HEALTH_POLL_S = 0.2        # how often the engine process asks its engine whether it can step
# where a short delta's step goes in a request's RequestMetrics fields
_METRIC = {f.name: i for i, f in enumerate(dataclasses.fields(RequestMetrics))}
_LAST_TOKEN_TIME, _NUM_GENERATION_TOKENS = _METRIC["last_token_time"], _METRIC["num_generation_tokens"]


class EngineProcessError(RuntimeError):
    """The engine process failed to start or died."""


# ---- the child ----

def _child_main(config: EngineConfig, conn: Connection, log_level: int) -> None:
    from kvfleet_runtime.engine.delta_engine import DeltaEngine

    # Signals to the server's process group (Ctrl-C in a terminal, a SIGTERM to the group) are
    # the parent's to act on: it stops this process after draining its requests (its shutdown;
    # or this loop seeing the pipe close; or SIGKILL). Ignored until this process has left
    # that group for one of its own, which its tensor-parallel workers join: the parent's
    # SIGKILL then takes them too (EngineProcess._kill).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.setpgid(0, 0)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s [engine process]: %(message)s")
    try:
        engine = DeltaEngine(config)
    except BaseException as e:      # noqa: BLE001 - the parent reports it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", engine.config, engine.served_model_name, engine.tokenizer,
               engine.eos_token_ids, engine.pooler))
    # messages go up from a thread of their own, so a step never waits on a parent busy with
    # the last one (a full pipe): the next step launches while this one's outputs are sent, and
    # a parent that lags reads several steps at once (_run_reader coalesces them)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_up, args=(conn, outbox), name="kvfleet-engine-up",
                              daemon=True)
    sender.start()
    # an engine that dies between steps or inside one (a tensor-parallel worker exited or hung:
    # its supervisor says so at once, while this loop may be waiting in a collective): the
    # parent hears it now, and this loop stops
    died = threading.Event()
    threading.Thread(target=_watch_health, args=(engine, outbox, died),
                     name="kvfleet-engine-health", daemon=True).start()
    try:
        while not died.is_set():
            busy = engine.has_unfinished_requests()
            changed, aborted = False, []
            while conn.poll(0 if busy else _IDLE_POLL_S):
                command = conn.recv()
                if command is None:
                    return
                changed = True
                if command[0] == "add":
                    _, rid, prompt, params, arrival, lora_request, priority = command
                    try:
                        engine.add_request(rid, prompt, params, arrival_time=arrival,
                                           lora_request=lora_request, priority=priority)
                    except (ValueError, TypeError) as e:
                        _post(outbox, ("rejected", rid, e))
                elif command[0] == "add_lora":
                    try:
                        engine.add_lora(command[1])
                        _post(outbox, ("lora", command[1].lora_int_id, None))
                    except (ValueError, TypeError) as e:
                        _post(outbox, ("lora", command[1].lora_int_id, e))
                else:
                    engine.abort_request(command[1])
                    aborted += command[1]
                busy = engine.has_unfinished_requests()
            if changed:     # aborts confirmed (the parent then ends their streams), fresh stats
                _post(outbox, ("commands", aborted, engine.get_stats()))
            if busy:
                outputs = engine.step()
                _post(outbox, ("step", outputs, engine.get_stats()))
            if not sender.is_alive():   # the pipe broke: the parent has gone
                return
    except (EOFError, OSError):     # the parent has gone
        return
    except BaseException as e:      # noqa: BLE001 - every death reaches the parent
        logger.exception("engine process died")
        _post(outbox, ("dead", f"{type(e).__name__}: {e}"))
    finally:
        died.set()      # the health watcher stops
        outbox.put(None)
        sender.join(_SENDER_JOIN_S)
        engine.shutdown()


def _watch_health(engine, outbox: queue.SimpleQueue, died: threading.Event) -> None:
    while not died.wait(_HEALTH_POLL_S):
        reason = engine.death_reason()
        if reason is not None and not died.is_set():
            died.set()
            _post(outbox, ("dead", reason))
            return


def _post(outbox: queue.SimpleQueue, message: tuple) -> None:
    """Queue a message for the parent, pickled here: the sending thread then only writes bytes
    (the GIL let go), instead of holding the GIL through a step's pickling while this thread
    waits for it to launch the next step."""
    outbox.put(ForkingPickler.dumps(message))


def _send_up(conn: Connection, outbox: queue.SimpleQueue) -> None:
    """The child's messages to the parent, in order, until None or a broken pipe (the parent's
    Connection.recv unpickles them)."""
    while (message := outbox.get()) is not None:
        try:
            conn.send_bytes(message)
        except OSError:
            return


# ---- the parent ----

class _Tracked:
    """A request as the merger has it so far: what its deltas said, added up."""
    __slots__ = ("prompt", "prompt_token_ids", "prompt_logprobs", "token_ids", "logprobs", "text",
                 "params", "detokenizers", "finished", "num_cached", "metrics", "ends", "embedding")

    def __init__(self, prompt: tuple, params: SamplingParams | None) -> None:
        self.prompt, self.prompt_token_ids, self.prompt_logprobs = prompt
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.text: dict[int, str] = {}
        self.params = params          # set: this process detokenizes the request
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.finished = False
        self.num_cached = 0
        self.metrics: list | None = None    # RequestMetrics' fields
        # completion index -> (cumulative_logprob, logprobs asked for, finish_reason, stop_reason)
        self.ends: dict[int, tuple] = {}
        self.embedding: list[float] | None = None


class OutputMerger:
    """The parent's side of DeltaEngine (delta_engine.py): deltas -> cumulative RequestOutputs
    (new lists each time, as LLMEngine builds them). The requests `expect`ed with params that
    `server_detokenizes` are detokenized here, from their token ids (their deltas carry no
    text), with the tokenizer given."""

    def __init__(self, tokenizer=None, eos_token_ids: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = set(eos_token_ids)     # the model's (LLMEngine.eos_token_ids)
        self._requests: dict[str, _Tracked] = {}
        self._expected: dict[str, SamplingParams] = {}

    def expect(self, request_id: str, params: SamplingParams) -> None:
        """A request about to be sent to the engine process (before any delta of it)."""
        if server_detokenizes(params) and params.pooling is None:     # (embeddings: no text)
            # as LLMEngine.add_request sets them: an EOS that ends the text shows none of it
            params._eos_token_ids = set() if params.ignore_eos else set(self._eos_token_ids)
            self._expected[request_id] = params

    def merge(self, steps: list[list[tuple]]) -> list[RequestOutput]:
        """One RequestOutput per request that the steps' deltas touch (in their order), as of
        the last of them: a reader that fell behind builds each output once, not once a step.
        A request forgotten (aborted) since its first delta gives none."""
        latest: dict[str, _Tracked] = {}
        for deltas in steps:
            for delta in deltas:
                if len(delta) == SHORT_DELTA_LEN:
                    tracked = self._absorb_token(*delta)
                else:
                    tracked = self._absorb(delta)
                if tracked is not None:
                    latest[delta[0]] = tracked
        return [self._output(rid, tracked) for rid, tracked in latest.items()]

    def _absorb_token(self, request_id: str, token_id: int, now: float) -> _Tracked | None:
        """A short delta: one more token of a running request's only completion."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return None
        (index,) = tracked.token_ids
        tracked.token_ids[index].append(token_id)
        if tracked.params is not None:
            tracked.text[index] = self._detokenize(tracked, index, (token_id,), None)
        metrics = tracked.metrics
        if metrics is not None:     # as _append keeps them: the token's time, one more counted
            metrics[_LAST_TOKEN_TIME] = now
            metrics[_NUM_GENERATION_TOKENS] += 1
        return tracked

    def _absorb(self, delta: tuple) -> _Tracked | None:
        request_id, finished, num_cached, metrics, prompt, completions, embedding = delta
        tracked = self._requests.get(request_id)
        if tracked is None:
            if prompt is None:
                return None
            tracked = self._requests[request_id] = _Tracked(
                prompt, self._expected.pop(request_id, None))
        tracked.finished, tracked.num_cached = finished, num_cached
        tracked.metrics = None if metrics is None else list(metrics)
        if embedding is not None:
            tracked.embedding = embedding
        for (index, keep, new_text, new_ids, cumulative, new_logprobs, finish_reason,
             stop_reason) in completions:
            tracked.ends[index] = (cumulative, new_logprobs is not None, finish_reason, stop_reason)
            if tracked.params is None:
                tracked.text[index] = tracked.text.get(index, "")[:keep] + new_text
            else:
                tracked.text[index] = self._detokenize(tracked, index, new_ids, finish_reason)
            tracked.token_ids.setdefault(index, []).extend(new_ids)
            if new_logprobs is not None:
                tracked.logprobs.setdefault(index, []).extend(new_logprobs)
        return tracked

    def _detokenize(self, tracked: _Tracked, index: int, new_ids: list[int] | tuple[int, ...],
                    finish_reason: str | None) -> str:
        """A completion's text after its new tokens, as the engine's detokenizer makes it."""
        detokenizer = tracked.detokenizers.get(index)
        if detokenizer is None:
            detokenizer = tracked.detokenizers[index] = IncrementalDetokenizer(
                self._tokenizer, tracked.prompt_token_ids, tracked.params)
        if finish_reason == "stop" and new_ids and stop_token_unshown(
                tracked.params, new_ids[-1], len(tracked.token_ids.get(index, ())) + len(new_ids)):
            new_ids = new_ids[:-1]
        update = detokenizer.update_one
        for token_id in new_ids:
            update(token_id)
        if finish_reason is not None:
            detokenizer.finish()
        return detokenizer.output_text

    def _output(self, request_id: str, tracked: _Tracked) -> RequestOutput:
        outputs = []
        for index, (cumulative, has_logprobs, finish_reason, stop_reason) in tracked.ends.items():
            logprobs = list(tracked.logprobs[index]) if has_logprobs else None
            outputs.append(CompletionOutput(index, tracked.text[index],
                                            list(tracked.token_ids[index]), cumulative, logprobs,
                                            finish_reason, stop_reason))
        if tracked.finished:
            del self._requests[request_id]
        metrics = tracked.metrics
        return RequestOutput(
            request_id=request_id, prompt=tracked.prompt, prompt_token_ids=tracked.prompt_token_ids,
            outputs=outputs, finished=tracked.finished,
            prompt_logprobs=None if tracked.prompt_logprobs is None else list(tracked.prompt_logprobs),
            num_cached_tokens=tracked.num_cached,
            metrics=None if metrics is None else RequestMetrics(*metrics), embedding=tracked.embedding)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)
            self._expected.pop(rid, None)


class EngineProcess:
    """The child process and the parent's end of its pipe. Stands in for LLMEngine where
    AsyncLLMEngine needs it (config, tokenizer, served_model_name, death_reason, shutdown,
    kill_workers)."""

    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")   # CUDA cannot be forked
        self._conn, child_conn = context.Pipe()
        # not a daemon: daemonic processes may not start the processes an engine may need
        self.process = context.Process(target=_child_main,
                                       args=(config, child_conn, logging.getLogger().level),
                                       name="kvfleet-engine", daemon=False)
        self.process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._closed = False
        # commands go out from a thread of their own: a burst of adds can fill the pipe while
        # the child is in a long step, and the event loop must not wait on that
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="kvfleet-engine-send",
                                        daemon=True)
        message = self._recv_ready()
        if message[0] != "ready":
            self.process.join(10)
            raise EngineProcessError(f"the engine process failed to start: {message[1]}")
        (_, self.config, self.served_model_name, self.tokenizer, self.eos_token_ids,
         self.pooler) = message
        self._sender.start()

    def _recv_ready(self) -> tuple:
        from multiprocessing.connection import wait
        ready = wait([self._conn, self.process.sentinel], READY_TIMEOUT_S)
        if self._conn in ready:
            try:
                return self._conn.recv()
            except EOFError:
                pass
        self.process.join(1)
        return ("failed", f"it exited with code {self.process.exitcode} before it was ready")

    def send(self, command: Any) -> None:
        """Queue a command for the child (None: stop); dropped once the child has gone (its
        death is reported)."""
        self._outbox.put(command)

    def _send_loop(self) -> None:
        while True:
            command = self._outbox.get()
            with self._send_lock:
                if self._closed:
                    return
                try:
                    self._conn.send(command)
                except OSError:
                    self._closed = True
                    return
            if command is None:
                return

    def pending(self) -> bool:
        """Whether a message from the child is waiting (or the pipe has closed: recv says so)."""
        try:
            return self._conn.poll(0)
        except (EOFError, OSError):
            return True

    def recv(self) -> tuple:
        """The child's next message; ("dead", why) once the pipe has closed."""
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            return ("dead", f"the engine process exited (code {self.process.exitcode})")

    def death_reason(self) -> str | None:
        if self.process.is_alive():
            return None
        return f"the engine process exited (code {self.process.exitcode})"

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the child (unfinished requests go with it); again: nothing more to do."""
        self.send(None)
        self.process.join(timeout)
        if self.process.is_alive():
            self._kill(5)
        with self._send_lock:
            self._closed = True
            self._conn.close()
        self._outbox.put(None)      # the sender, if still waiting, sees the pipe closed

    def kill_workers(self, wait_s: float) -> None:
        """SIGKILL the engine process and its tensor-parallel workers (the server is about to
        exit without its shutdown)."""
        if self.process.is_alive():
            self._kill(wait_s)

    def _kill(self, wait_s: float) -> None:
        """SIGKILL the child's process group (the child and its workers), then wait up to
        wait_s for the child."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):   # not yet a group of its own
            self.process.kill()
        self.process.join(wait_s)
