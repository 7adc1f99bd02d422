"""The worker processes of a tensor-parallel engine, started and supervised by rank 0.

Rank 0 is the engine's own process: it schedules, drives every step and samples. Ranks
1..N-1 each run `worker_main` in a spawned process (one per GPU): join the group, load their
shard, size their KV cache (the pool is the minimum over ranks), report ready over a pipe
(or report why they could not), then run rank 0's steps until told to stop.

A dead worker must not leave rank 0 hanging: on gloo the pending collective fails at once
(the peer's socket closes); a supervisor thread also polls the processes, marks the group
dead (the engine reports unhealthy without waiting for a step) and, on GPU, aborts the NCCL
group so that no rank stays stuck in an all-reduce until the NCCL timeout. A worker that
hangs without dying is caught by the same thread: an engine step that has not returned
within the step timeout (KVFLEET_TP_STEP_TIMEOUT_S) marks the group dead and kills the
workers, which fails rank 0's pending collective.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from kvfleet_runtime.config import EngineConfig
from kvfleet_runtime.distributed.communication import broadcast_step
from kvfleet_runtime.distributed.parallel_state import (
    destroy_tensor_parallel,
    forget_tensor_parallel,
    get_state,
    init_tensor_parallel,
)

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0   # a forward's collective (and the rendezvous) waits at most this
JOIN_TIMEOUT_S = 120.0         # a spawned worker imports torch and reaches the rendezvous
READY_TIMEOUT_S = 600.0        # loading a shard and profiling memory
POLL_S = 0.2                   # how often the supervisor looks at the workers
FAIL_WAIT_S = 1.0              # after a failed step, how long to wait for a worker to exit
STOP_GRACE_S = 5.0             # a stopped worker gets this long before it is killed
TEARDOWN_TIMEOUT_S = 10.0      # rank 0's NCCL teardown at shutdown waits at most this
# An engine step (rank 0's step() call: scheduling, the forward on every rank, sampling) that
# has not returned after this long means a rank hung; KVFLEET_TP_STEP_TIMEOUT_S overrides it.
# Generous: on a GPU a step's first use of a kernel compiles it (seconds each) and a long
# prefill of a large model takes seconds; on a CPU a prefill chunk of thousands of tokens
# through a 7B model takes minutes.
STEP_TIMEOUT_S = COLLECTIVE_TIMEOUT_S
CPU_STEP_TIMEOUT_S = 1800.0


def step_timeout_s(on_gpu: bool = True) -> float:
    """KVFLEET_TP_STEP_TIMEOUT_S (seconds, > 0), else STEP_TIMEOUT_S (CPU_STEP_TIMEOUT_S on a
    CPU)."""
    value = os.environ.get("KVFLEET_TP_STEP_TIMEOUT_S", "")
    if not value:
        return STEP_TIMEOUT_S if on_gpu else CPU_STEP_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"KVFLEET_TP_STEP_TIMEOUT_S must be a positive number of seconds; "
                         f"got {value!r}")
    return seconds


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone; the engine cannot step any more."""


@dataclass
class WorkerJoining:
    """Sent just before the rendezvous, so rank 0 never waits there for a worker that died."""
    rank: int


@dataclass
class WorkerReady:
    rank: int


@dataclass
class WorkerFailed:
    rank: int
    error: str          # the worker's traceback


def _device_of(config: EngineConfig, rank: int) -> torch.device:
    on_gpu = config.torch_device.type == "cuda"
    return torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")


def worker_main(rank: int, config: EngineConfig, init_method: str, conn: Connection) -> None:
    """Entry point of rank `rank` >= 1 (runs in its own spawned process)."""
    from kvfleet_runtime.engine.model_runner import ModelRunner
    from kvfleet_runtime.layers.backend import set_backend
    from kvfleet_runtime.loader import load_model
    dump_after = os.environ.get("KVFLEET_WORKER_STACKS_AFTER_S")
    if dump_after:     # debugging a hang: every thread's stack to stderr, every N seconds
        import faulthandler
        faulthandler.dump_traceback_later(float(dump_after), repeat=True)
    try:
        device = _device_of(config, rank)
        config.device = str(device)
        conn.send(WorkerJoining(rank))
        init_tensor_parallel(rank, config.tensor_parallel_size, init_method, device,
                             COLLECTIVE_TIMEOUT_S)
        set_backend(config.attention_backend)
        torch.manual_seed(config.seed)
        loaded = load_model(config)
        config.finalize(loaded.config.max_position_embeddings)
        runner = ModelRunner(config, loaded)
    except BaseException:
        conn.send(WorkerFailed(rank, traceback.format_exc()))
        raise
    conn.send(WorkerReady(rank))
    while runner.execute_remote():
        pass
    if device.type == "cuda":
        # Released. No NCCL teardown: on the H200 both destroy_process_group and an abort hung
        # on every rank once collectives had been captured in CUDA graphs (pytorch#115388).
        # Nothing is left to communicate; exiting frees the communicator with the process.
        conn.close()
        os._exit(0)
    destroy_tensor_parallel()


def abort_device_group(device: torch.device) -> None:
    """Abort this rank's NCCL group (its pending collectives fail at once, its teardown waits
    for no other rank); nothing for gloo."""
    group = get_state().device_group
    if device.type != "cuda" or group is None:
        return
    from torch.distributed.distributed_c10d import _abort_process_group
    try:
        _abort_process_group(group)
    except Exception as e:  # noqa: BLE001 - aborted already (the supervisor); teardown goes on
        log.warning("aborting the tensor-parallel group: %s", e)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Ranks 1..N-1 of an engine; creating it makes this process rank 0 of the group."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        if config.torch_device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size ({size}) must not exceed the GPUs visible "
                             f"here ({torch.cuda.device_count()})")
        self.step_timeout_s = step_timeout_s(config.torch_device.type == "cuda")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")     # CUDA cannot be used in a forked child
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        for rank in range(1, size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(rank, config, init_method, child),
                               name=f"kvfleet-tp-worker-{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.dead: str | None = None
        self._step_since: float | None = None    # when the engine step now running began
        self._ready = False        # workers in their step loop, where a stop message reaches them
        self._stopping = threading.Event()
        self._device = _device_of(config, 0)
        try:
            self._await(WorkerJoining, JOIN_TIMEOUT_S)
            init_tensor_parallel(0, size, init_method, self._device, COLLECTIVE_TIMEOUT_S)
        except BaseException:
            self._kill_all()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="kvfleet-tp-supervisor",
                                            daemon=True)
        self._supervisor.start()

    def wait_ready(self) -> None:
        """Return once every worker has loaded its shard; raises with a worker's error."""
        self._await(WorkerReady, READY_TIMEOUT_S)
        self._ready = True

    def _await(self, kind: type, timeout_s: float) -> list:
        """One `kind` message from every worker; a failure report or a silent exit raises."""
        pending = dict(zip(self.conns, range(1, len(self.conns) + 1), strict=True))
        deadline = time.monotonic() + timeout_s
        messages = []
        while pending:
            ready = wait(list(pending), timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise WorkerDiedError(f"tensor-parallel ranks {sorted(pending.values())} sent "
                                      f"no {kind.__name__} within {timeout_s:.0f} s")
            for conn in ready:
                rank = pending.pop(conn)
                msg = self._receive(conn, rank)
                if not isinstance(msg, kind):
                    raise WorkerDiedError(f"tensor-parallel rank {rank} failed to start:\n"
                                          f"{msg.error}")
                messages.append(msg)
        return messages

    def startup_error(self) -> str | None:
        """A worker's own report of why it failed, if one has arrived (rank 0 then usually
        sees only a broken collective)."""
        for rank, conn in enumerate(self.conns, 1):
            if conn.poll(0):
                msg = self._receive(conn, rank)
                if isinstance(msg, WorkerFailed):
                    return f"tensor-parallel rank {rank} failed to start:\n{msg.error}"
        return None

    @staticmethod
    def _receive(conn: Connection, rank: int) -> WorkerReady | WorkerFailed:
        try:
            return conn.recv()
        except EOFError:
            return WorkerFailed(rank, "the process exited without a word (killed?)")

    def is_alive(self) -> bool:
        if self.dead is None:
            self._poll()
        return self.dead is None

    def check_alive(self) -> None:
        if not self.is_alive():
            raise WorkerDiedError(f"{self.dead}; the engine has stopped")

    def fail(self, error: BaseException) -> WorkerDiedError:
        """A step broke (a collective failed): stop every rank; returns the error to raise."""
        # the dead peer's socket closes a moment before its exit code can be read: wait for
        # it, so the error names the rank
        exited = wait([proc.sentinel for proc in self.procs], timeout=FAIL_WAIT_S)
        for proc in self.procs:
            if proc.sentinel in exited:
                proc.join()        # its sentinel closed: it is exiting, reap it
        self._poll()
        self.dead = self.dead or f"a tensor-parallel step failed: {error}"
        self.shutdown()
        return WorkerDiedError(f"{self.dead}; the engine has stopped")

    def step_began(self) -> None:
        """Rank 0 entered an engine step: the supervisor times it from now."""
        self._step_since = time.monotonic()

    def step_ended(self) -> None:
        self._step_since = None

    def _poll(self) -> None:
        for rank, proc in enumerate(self.procs, 1):
            if proc.exitcode is not None and self.dead is None:
                self.dead = f"tensor-parallel rank {rank} exited with code {proc.exitcode}"

    def _overdue_step(self) -> bool:
        """A step older than the step timeout while every worker lives: a rank hung."""
        since = self._step_since
        return (since is not None and self.dead is None
                and time.monotonic() - since > self.step_timeout_s)

    def _supervise(self) -> None:
        while not self._stopping.wait(POLL_S):
            self._poll()
            hung = self._overdue_step()
            if hung:
                self.dead = (f"no tensor-parallel step finished within {self.step_timeout_s:g} s "
                             f"(KVFLEET_TP_STEP_TIMEOUT_S) with every worker alive: a rank hung")
            if self.dead is not None and not self._stopping.is_set():
                log.error("%s; the engine stops", self.dead)
                if hung:
                    # a killed peer fails rank 0's pending collective (gloo: its socket
                    # closes; NCCL: with the abort below)
                    for proc in self.procs:
                        proc.kill()
                # NCCL would wait out its timeout in a collective with the dead rank
                self._abort_device_group()
                return

    def _abort_device_group(self) -> None:
        abort_device_group(self._device)

    def shutdown(self) -> None:
        """Release the workers from their step loop (kill them if they do not leave, if they
        never got there, or if the group is broken) and leave the group. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        released = False
        if self._ready and self.is_alive():
            try:
                broadcast_step(None, self._device)
                released = True
            except RuntimeError as e:      # a worker died just now
                log.warning("could not release the tensor-parallel workers: %s", e)
        # The workers leave first (a released one exits without NCCL teardown; one that is
        # not released is killed), then this rank tears its group down, bounded: on the H200
        # NCCL's teardown (destroy_process_group, and an abort too) hung on every rank once
        # collectives had been captured in CUDA graphs (pytorch#115388).
        self._kill_all(grace_s=STOP_GRACE_S if released else 0.0)
        self._leave_group()
        self.dead = self.dead or "the engine was shut down"

    def _leave_group(self) -> None:
        def teardown() -> None:
            self._abort_device_group()
            destroy_tensor_parallel()
        if self._device.type != "cuda":
            teardown()
            return
        thread = threading.Thread(target=teardown, name="kvfleet-tp-teardown", daemon=True)
        thread.start()
        thread.join(TEARDOWN_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the NCCL group's teardown did not finish in %.0f s (pytorch#115388: "
                        "collectives captured in CUDA graphs); it is left to the process's exit, "
                        "and this process cannot start another tensor-parallel engine",
                        TEARDOWN_TIMEOUT_S)
            forget_tensor_parallel()

    def kill_now(self, wait_s: float) -> None:
        """SIGKILL every worker (safe beside a shutdown under way in another thread) and
        wait up to wait_s in all for them to exit: a GPU process's exit can take seconds."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        deadline = time.monotonic() + wait_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))

    def _kill_all(self, grace_s: float = 0.0) -> None:
        for proc in self.procs:
            proc.join(grace_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
