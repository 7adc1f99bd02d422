"""`kvfleet serve --tensor-parallel-size 2` as a real process, the engine in a thread of the
server or in a process of its own (--engine-process, whose child then starts the worker): it
answers; a killed worker stops the server (exit 1) within seconds, or with
--keep-alive-on-engine-death turns requests and /health into errors; a worker that hangs
without dying fails the request after the step timeout and stops the server; no worker (and no
engine process) outlives the server. On CPUs over gloo (CI), and on two
GPUs over NCCL and symmetric memory (marker gpu), where rank 0 is left spinning on the GPU in a
collective with a dead or stopped peer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from support.server import running_server, spawned_child

DEVICES = pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 GPUs")])])

TP_FLAGS = ("--tensor-parallel-size", "2", "--served-model-name", "tp", "--max-num-seqs", "4")
# the engine in the server's process (the default with tensor parallelism) or in its own
MODES = pytest.mark.parametrize("mode", ["--no-engine-process", "--engine-process"])


def _worker_pid(server_pid: int, mode: str) -> tuple[int, int | None]:
    """The worker's pid and the engine process's (None: the engine runs in the server's)."""
    if mode == "--engine-process":
        engine = spawned_child(server_pid)
        return spawned_child(engine), engine
    return spawned_child(server_pid), None


def _gone(*pids: int | None) -> bool:
    return not any(Path(f"/proc/{pid}").exists() for pid in pids if pid is not None)


def _complete(base_url: str, prompt: str, timeout: float = 30.0) -> tuple[int, dict]:
    body = json.dumps({"model": "tp", "prompt": prompt, "max_tokens": 4,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _exit_code_within(server, seconds: float) -> int:
    try:
        return server.process.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"kvfleet serve still running {seconds} s after its engine died:\n"
                             f"{server.log()}") from None


@DEVICES
@MODES
@pytest.mark.timeout(180)
def test_a_killed_worker_stops_the_server(tp_model_dir, device, mode):
    with running_server(tp_model_dir("llama3-gqa"), "--device", device, mode, *TP_FLAGS) as server:
        status, body = _complete(server.base_url, "Hello there")
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        worker, engine = _worker_pid(server.pid, mode)
        os.kill(worker, signal.SIGKILL)
        # idle: the worker supervisor notices, the server stops without a request
        assert _exit_code_within(server, 10) == 1
        log = server.log()
        assert "tensor-parallel rank 1 exited with code -9" in log and "exits 1" in log, log
    assert _gone(worker, engine)


@DEVICES
@MODES
@pytest.mark.timeout(180)
def test_kept_alive_a_killed_worker_fails_health_and_requests(tp_model_dir, device, mode):
    with running_server(tp_model_dir("llama3-gqa"), "--device", device, mode, *TP_FLAGS,
                        "--keep-alive-on-engine-death") as server:
        status, body = _complete(server.base_url, "Hello there")
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        worker, engine = _worker_pid(server.pid, mode)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        # an idle server notices without a request: /health consults the worker supervisor
        while server.get("/health")[0] != 503:
            assert time.monotonic() - t0 < 5, "/health still 200 five seconds after the kill"
            time.sleep(0.1)
        status, body = _complete(server.base_url, "Hello again")
        assert status >= 500, body
        health, text = server.get("/health")
        assert health == 503 and "tensor-parallel rank 1 exited" in text, text
        assert time.monotonic() - t0 < 5
        assert server.process.poll() is None      # still serving its 503s
    assert _gone(worker, engine)


@DEVICES
@MODES
@pytest.mark.timeout(180)
def test_a_hung_worker_fails_the_step_after_the_step_timeout(tp_model_dir, device, mode):
    # SIGSTOP: the worker lives but never answers; rank 0 waits in a collective with it
    # (on GPUs the first request's steps may compile Triton kernels: longer than 3 s)
    timeout_s = 3.0 if device == "cpu" else 30.0
    with running_server(tp_model_dir("llama3-gqa"), "--device", device, mode, *TP_FLAGS,
                        env={"KVFLEET_TP_STEP_TIMEOUT_S": str(timeout_s)}) as server:
        status, body = _complete(server.base_url, "Hello there")
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        worker, engine = _worker_pid(server.pid, mode)
        os.kill(worker, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            status, body = _complete(server.base_url, "Hello again", timeout=timeout_s + 20)
            waited = time.monotonic() - t0
            assert status >= 500, body
            assert "hung" in json.dumps(body), body
            # not before the timeout (the step did hang), and soon after it
            assert timeout_s <= waited < timeout_s + 10, waited
            assert _exit_code_within(server, 10) == 1
            assert "a rank hung" in server.log()
        finally:
            if Path(f"/proc/{worker}").exists():
                os.kill(worker, signal.SIGCONT)
    assert _gone(worker, engine)
