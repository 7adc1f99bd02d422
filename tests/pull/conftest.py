"""Fixtures for `kvfleet pull`: one SeaweedFS per test session and a sharded tiny Llama uploaded to it;
a Hugging Face Hub stand-in per test."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.hub import HubServer
from support.s3 import S3Server, start_seaweedfs
from support.tiny_models import make_tiny_model

BUCKET = "models"
PREFIX = "tiny-llama"
PART_SIZE = 5 << 20   # the smallest S3 multipart part: the embedding shards get "-N" ETags


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), tls=True)
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real HF folder: config.json, safetensors shards + index, tokenizer."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("ckpt") / "tiny-llama", max_shard_size="200KB")


@pytest.fixture(scope="session")
def uploaded(s3: S3Server, checkpoint: Path) -> str:
    s3.upload_dir(checkpoint, BUCKET, PREFIX, multipart_chunksize=PART_SIZE)
    return f"s3://{BUCKET}/{PREFIX}"


@pytest.fixture
def hub() -> Iterator[HubServer]:
    server = HubServer()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class PullRun:
    returncode: int
    stderr: str


def run_pull(s3: S3Server | None, *args: str, env: dict[str, str] | None = None) -> PullRun:
    """`kvfleet pull --no-progress ...` in this process, with `env` as the whole environment
    (the S3 server's credentials by default), its exit code and stderr captured."""
    from kvfleet_runtime import pull

    env = env if env is not None else (s3.env() if s3 else dict(os.environ))
    saved = dict(os.environ)
    err = io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    try:
        with contextlib.redirect_stderr(err):
            code = pull.main(["--no-progress", *args])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return PullRun(code, err.getvalue())


def pull_process(server: S3Server | HubServer, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m kvfleet_runtime.pull ...` as its own process (for killing it), in `env` (the server's by default)."""
    return subprocess.Popen([sys.executable, "-m", "kvfleet_runtime.pull", "--no-progress", *args],
                            env=env if env is not None else server.env(), stderr=subprocess.PIPE, text=True)


def run_pull_process(server: S3Server | HubServer, *args: str, env: dict[str, str] | None = None) -> PullRun:
    """pull_process() run to its end. Hub pulls run this way: huggingface_hub reads HF_ENDPOINT and
    HF_HUB_OFFLINE (which scripts/test sets) once, at import."""
    proc = pull_process(server, *args, env=env)
    try:
        _, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return PullRun(proc.returncode, stderr)


def tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file a runtime could load (our bookkeeping excluded)."""
    from kvfleet_runtime import pull as pullmod

    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".kvfleet-pull")
            and pullmod.STAGING not in p.parts}


def wait_for_chunks(proc: subprocess.Popen, state: Path, at_least: int) -> int:
    """Poll a running pull's resume state until `at_least` chunks are recorded done."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            done = len(json.loads(state.read_text())["done"])
            if done >= at_least:
                return done
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            pytest.fail(f"pull ended early ({proc.returncode}): {proc.communicate()[1]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no progress recorded in {state}")
