"""A real `kvfleet serve` subprocess for tests.

`start_server(model, *flags)` runs `python -m kvfleet_runtime.cli serve` bound to
127.0.0.1 with `--port 0` (the kernel picks a free port, so parallel test runs
never race for one), reads the port from uvicorn's start-up line and waits
until /health answers 200. `ServerProcess.stop()` signals the PID it started.
The server's output goes to a log file whose tail is put into every failure; keep
`--log-level` at info or lower, since the port is read from uvicorn's info line.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

_LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@dataclass
class ServerProcess:
    process: subprocess.Popen = field(repr=False)
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """What the official openai client takes as base_url."""
        return self.base_url + "/v1"

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        """(status, body) of a GET; no exception for error statuses."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200, body
        return body

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (summed over the labels not given); 0 if absent."""
        return sum(sample.value for family in text_string_to_metric_families(self.metrics())
                   for sample in family.samples
                   if sample.name == name
                   and all(sample.labels.get(k) == v for k, v in labels.items()))

    def idle(self) -> bool:
        """Nothing running, nothing waiting, no KV block held."""
        return (self.metric("kvfleet_num_requests_running") == 0
                and self.metric("kvfleet_num_requests_waiting") == 0
                and self.metric("kvfleet_kv_cache_usage_perc") == 0)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal our PID; SIGKILL it if it outlives timeout. Returns the exit code."""
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


def start_server(model: str | os.PathLike | None, *flags: str, api_key: str | None = None,
                 env: dict[str, str] | None = None, timeout: float = 300.0) -> ServerProcess:
    """Start `kvfleet serve [model] flags...` and wait until it is healthy."""
    log_fd, log_name = tempfile.mkstemp(prefix="kvfleet-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "kvfleet_runtime.cli", "serve",
           *([str(model)] if model is not None else []),
           "--host", "127.0.0.1", "--port", "0", *flags]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
    process = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, env=full_env,
                               stdin=subprocess.DEVNULL)
    os.close(log_fd)
    server = ServerProcess(process=process, port=0, log_path=Path(log_name), api_key=api_key)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"kvfleet serve exited with {process.returncode}:\n"
                                   f"{server.log()}")
            if not server.port:
                found = _LISTENING.search(server.log(tail=100_000))
                server.port = int(found.group(1)) if found else 0
            if server.port and _healthy(server):
                return server
            time.sleep(0.2)
        raise TimeoutError(f"kvfleet serve not healthy after {timeout} s:\n{server.log()}")
    except BaseException:
        server.stop(signal.SIGKILL)
        raise


def _healthy(server: ServerProcess) -> bool:
    try:
        return server.get("/health", timeout=2.0)[0] == 200
    except OSError:
        return False


@contextmanager
def running_server(model: str | os.PathLike | None, *flags: str,
                   **kwargs) -> Iterator[ServerProcess]:
    """start_server as a context manager (module-scoped fixtures: `with running_server(...)`)."""
    server = start_server(model, *flags, **kwargs)
    try:
        yield server
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def spawned_child(pid: int) -> int:
    """The process `pid` spawned with multiprocessing (the engine process of a server, a
    tensor-parallel worker of an engine); not its resource tracker."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    (child,) = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return child


@dataclass
class LeftStream:
    """What a client saw before it left a stream, and how the request ended."""
    lines: list[str]
    running: float              # kvfleet_num_requests_running while the client still read
    kv_cache_usage: float
    seconds_until_idle: float   # from closing the connection


def leave_mid_stream(server: ServerProcess, path: str, body: dict, lines: int) -> LeftStream:
    """Read a stream's first `lines` lines, read the metrics, close the connection: the request
    must end as an abort (one more kvfleet_request_success_total{finished_reason="abort"})."""
    aborted = server.metric("kvfleet_request_success_total", finished_reason="abort")
    with httpx.Client(base_url=server.base_url, timeout=60) as http, \
            http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        # held until the connection closes: an iterator dropped early closes it (its generator's
        # cleanup), and the metrics below would race the abort
        stream = r.iter_lines()
        got = list(itertools.islice(stream, lines))
        running = server.metric("kvfleet_num_requests_running")
        usage = server.metric("kvfleet_kv_cache_usage_perc")
    left = time.monotonic()
    while not server.idle():
        assert time.monotonic() - left < 10.0, server.metrics()
        time.sleep(0.05)
    idle = time.monotonic() - left
    assert server.metric("kvfleet_request_success_total", finished_reason="abort") == aborted + 1
    return LeftStream(got, running, usage, idle)


def serve_exit_code(flags: list[str]) -> int:
    """`kvfleet serve x.gguf --device cpu FLAGS` run in this process, as far as it goes with a
    model that does not exist: its exit code (argparse's own refusals included)."""
    from kvfleet_runtime.cli import main
    try:
        return main(["serve", "x.gguf", "--device", "cpu", *flags])
    except SystemExit as e:
        return e.code
