"""The `kvfleet-operator` console script, run as a process the way the operator image runs it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from kvfleet_operator.main import kopf_args
from operator_harness import minimal_llmservice
from support.kube import wait_for

BIN = Path(sys.executable).parent / "kvfleet-operator"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_arguments_become_a_kopf_command_line():
    assert kopf_args([])[-1] == "--all-namespaces"
    args = kopf_args(["--namespace", "llm", "-n", "b", "--liveness", "http://127.0.0.1:1/h"])
    assert "--all-namespaces" not in args
    assert args[args.index("--liveness") + 1] == "http://127.0.0.1:1/h"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == ["llm", "b"]
    assert args[:2] == ["run", "--standalone"] and "kvfleet_operator.main" in args


def test_console_script_reconciles_and_serves_liveness(cluster, tmp_path):
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = (tmp_path / "operator.log").open("w")
    process = subprocess.Popen([str(BIN), "--namespace", "default",
                                "--liveness", f"http://127.0.0.1:{port}/healthz"],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        cluster.create(minimal_llmservice(model={"uri": "/opt/models/tiny"},
                                          resources={"gpus": 0}), "llmservices")
        wait_for(lambda: cluster.get("apps/v1", "deployments", "default", "demo")
                 or process.poll() is not None, timeout=30,
                 what="the Deployment made by the console script")
        assert process.poll() is None, (tmp_path / "operator.log").read_text()[-3000:]

        def alive() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(alive, timeout=15, what="the liveness endpoint")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        finally:
            if process.poll() is None:
                process.kill()
            log.close()
    assert process.returncode == 0, (tmp_path / "operator.log").read_text()[-3000:]
