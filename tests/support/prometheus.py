"""A real Prometheus for tests: the Debian package's binary (scripts/install-tools installs it).

`start_prometheus(workdir, targets=[...])` writes a config scraping the given
host:port targets every `scrape_interval`, starts `prometheus` on a free
127.0.0.1 port with its own data dir and waits for /-/ready; rule files and any
other top-level config keys can be passed. `PrometheusServer.query()` runs an
instant PromQL query through the HTTP API, `wait_for()` polls one until a
predicate holds. `stop()` signals the PID it started, nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise FileNotFoundError("prometheus not found on PATH; run scripts/install-tools "
                                "(apt-get install prometheus)")
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrometheusServer:
    url: str
    workdir: Path
    process: subprocess.Popen = field(repr=False)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns "data" of a success answer, raises with the error."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant vector query: [{"metric": {...}, "value": [ts, "1.5"]}, ...]."""
        return self.api("query", query=promql)["result"]

    def wait_for(self, promql: str, predicate: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll promql until predicate(result) holds; TimeoutError shows the last result."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.5)
        raise TimeoutError(f"{promql!r} still {result} after {timeout} s; targets: "
                           f"{self.api('targets')['activeTargets']}")

    def log(self, tail: int = 3000) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-tail:]

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_prometheus(workdir: str | os.PathLike, targets: list[str], *,
                     scrape_interval: str = "1s", job: str = "kvfleet",
                     rule_files: list[str | os.PathLike] | None = None,
                     extra_config: dict[str, Any] | None = None,
                     timeout: float = 30.0) -> PrometheusServer:
    """Start Prometheus scraping `targets` ("127.0.0.1:PORT") as job `job`."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
    }
    if rule_files:
        config["rule_files"] = [str(Path(f).resolve()) for f in rule_files]
    config.update(extra_config or {})
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    for attempt in range(3):
        # the port is free when picked; another process may bind it before prometheus does
        # (then it exits at once): a fresh port then
        port = _free_port()
        log = open(workdir / "prometheus.log", "wb")
        process = subprocess.Popen(
            [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        server = PrometheusServer(url=f"http://127.0.0.1:{port}", workdir=workdir, process=process)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                if "address already in use" in server.log() and attempt < 2:
                    break
                raise RuntimeError(f"prometheus exited with {process.returncode}:\n{server.log()}")
            try:
                with urllib.request.urlopen(server.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return server
            except OSError:
                pass
            time.sleep(0.2)
        else:
            break
    server.stop()
    raise TimeoutError(f"prometheus not ready after {timeout} s:\n{server.log()}")
