"""Fixtures for `kvfleet pull`: one SeaweedFS per test session and a sharded tiny Llama uploaded to it."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
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


def pull_process(s3: S3Server, *args: str) -> subprocess.Popen:
    """`python -m kvfleet_runtime.pull ...` as its own process (for killing it)."""
    return subprocess.Popen([sys.executable, "-m", "kvfleet_runtime.pull", "--no-progress", *args],
                            env=s3.env(), stderr=subprocess.PIPE, text=True)
