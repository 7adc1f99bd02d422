"""`kvfleet pull` against a real S3 server (SeaweedFS with credentials enforced)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from kvfleet_runtime import pull as pullmod
from support.s3 import S3Server

from pull.conftest import BUCKET, PART_SIZE, pull_process, run_pull, tree, wait_for_chunks


def test_sharded_checkpoint_round_trip(s3: S3Server, uploaded: str, checkpoint: Path, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    r = run_pull(s3, uploaded, str(dest), "--chunk-size", "1M", "--jobs", "8")
    assert r.returncode == 0, r.stderr
    assert tree(dest) == tree(checkpoint)
    assert len(list(dest.glob("model-*.safetensors"))) >= 3, "the fixture should be sharded"
    assert not (dest / pullmod.STAGING).exists()
    marker = json.loads((dest / pullmod.MARKER).read_text())
    assert marker["source"] == uploaded + "/"
    # the embedding shards were multipart uploads: their "-N" ETags were checked, not skipped
    assert any("-" in f["etag"] for f in marker["files"])
    from transformers import AutoConfig, AutoTokenizer
    assert AutoConfig.from_pretrained(dest).model_type == "llama"
    assert AutoTokenizer.from_pretrained(dest).encode("hello")


def test_repull_of_complete_dest_is_skipped_fast(s3: S3Server, uploaded: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "model"
    assert run_pull(s3, uploaded, str(dest)).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file()}
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    result = pullmod.pull(uploaded, dest, pullmod.PullOptions(progress=False))
    elapsed = time.monotonic() - t0
    assert result.up_to_date and result.bytes_fetched == 0
    # one listing and no download: typically ~0.1 s; the bound leaves room for a busy CI machine
    assert elapsed < 2.0, f"an up-to-date check took {elapsed:.2f} s"
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file() and p.name != pullmod.LOCK} == \
        {p: t for p, t in before.items() if p.name != pullmod.LOCK}
    r = run_pull(s3, uploaded, str(dest))
    assert r.returncode == 0 and "up to date" in r.stderr


def test_changed_and_removed_objects_are_refreshed(s3: S3Server, checkpoint: Path, tmp_path: Path) -> None:
    src = f"s3://{BUCKET}/refresh"
    s3.upload_dir(checkpoint, BUCKET, "refresh", multipart_chunksize=PART_SIZE)
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key="refresh/extra.txt", Body=b"stale")
    dest = tmp_path / "model"
    assert run_pull(s3, src, str(dest)).returncode == 0
    assert (dest / "extra.txt").read_bytes() == b"stale"
    client.put_object(Bucket=BUCKET, Key="refresh/config.json", Body=b'{"model_type": "llama", "changed": 1}')
    client.delete_object(Bucket=BUCKET, Key="refresh/extra.txt")
    r = run_pull(s3, src, str(dest))
    assert r.returncode == 0, r.stderr
    assert json.loads((dest / "config.json").read_text())["changed"] == 1
    assert not (dest / "extra.txt").exists()
    # only the changed object travelled again
    assert "fetched 0.0 MiB" in r.stderr


def test_resume_after_stopped_and_killed_downloads(s3: S3Server, tmp_path: Path) -> None:
    blob = os.urandom(24 << 20)
    s3.client().put_object(Bucket=BUCKET, Key="resume/weights.bin", Body=blob)  # single-part ETag: md5
    src_root = tmp_path / "src"
    src_root.mkdir()
    (src_root / "shard.bin").write_bytes(blob[::-1])
    s3.upload_dir(src_root, BUCKET, "resume", multipart_chunksize=PART_SIZE)   # multipart ETag
    s3.client().put_object(Bucket=BUCKET, Key="resume/empty.txt", Body=b"")
    dest = tmp_path / "model"
    slow = ("--chunk-size", "1M", "--jobs", "2", "--max-bandwidth", "8M")
    state = dest / pullmod.STAGING / "weights.bin.part.json"

    # SIGTERM (a pod being deleted): exits 130, keeps what it staged
    first = pull_process(s3, f"s3://{BUCKET}/resume", str(dest), *slow)
    stopped_at = wait_for_chunks(first, state, 2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == pullmod.ExitCode.INTERRUPTED
    assert "run the same command again to resume" in first.communicate()[1]
    assert len(json.loads(state.read_text())["done"]) >= stopped_at

    # SIGKILL (OOM, node loss): no chance to clean up, the worst case
    second = pull_process(s3, f"s3://{BUCKET}/resume", str(dest), *slow)
    wait_for_chunks(second, state, stopped_at + 2)
    os.kill(second.pid, signal.SIGKILL)
    second.wait()
    assert not (dest / "weights.bin").exists() and not (dest / pullmod.MARKER).exists()

    r = run_pull(s3, f"s3://{BUCKET}/resume", str(dest), "--chunk-size", "1M")
    assert r.returncode == 0, r.stderr
    assert (dest / "weights.bin").read_bytes() == blob
    assert (dest / "shard.bin").read_bytes() == blob[::-1]
    assert (dest / "empty.txt").read_bytes() == b""
    resumed = float(r.stderr.split("resumed ")[1].split(" MiB")[0])
    assert resumed >= 4, r.stderr


def test_corrupt_partial_is_fetched_again_not_installed(s3: S3Server, tmp_path: Path) -> None:
    blob = os.urandom(3 << 20)
    s3.client().put_object(Bucket=BUCKET, Key="corrupt/weights.bin", Body=blob)
    dest = tmp_path / "model"
    staging = dest / pullmod.STAGING
    staging.mkdir(parents=True)
    etag = s3.client().head_object(Bucket=BUCKET, Key="corrupt/weights.bin")["ETag"].strip('"')
    # a staged copy whose state records every chunk with its right MD5, but whose bytes are wrong
    (staging / "weights.bin.part").write_bytes(b"\0" * len(blob))
    done = {str(i): hashlib.md5(blob[i << 20:(i + 1) << 20]).hexdigest() for i in range(3)}
    (staging / "weights.bin.part.json").write_text(json.dumps(
        {"fingerprint": etag, "size": len(blob), "chunk_size": 1 << 20, "done": done}))
    r = run_pull(s3, f"s3://{BUCKET}/corrupt", str(dest), "--chunk-size", "1M")
    assert r.returncode == 0, r.stderr
    assert "fetching it again" in r.stderr and "ETag" in r.stderr
    assert (dest / "weights.bin").read_bytes() == blob


def test_sha256_manifest_mismatch_installs_nothing(s3: S3Server, checkpoint: Path, tmp_path: Path) -> None:
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key="badsum/config.json", Body=(checkpoint / "config.json").read_bytes())
    client.put_object(Bucket=BUCKET, Key="badsum/tokenizer.json", Body=(checkpoint / "tokenizer.json").read_bytes())
    good = hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()
    client.put_object(Bucket=BUCKET, Key="badsum/SHA256SUMS",
                      Body=f"{good}  config.json\n{'0' * 64}  tokenizer.json\n".encode())
    dest = tmp_path / "model"
    r = run_pull(s3, f"s3://{BUCKET}/badsum", str(dest))
    assert r.returncode == pullmod.ExitCode.VERIFY_FAILED, r.stderr
    assert "tokenizer.json" in r.stderr and "SHA256SUMS" in r.stderr
    assert tree(dest) == {}, "nothing may reach DEST when a file fails verification"
    assert not (dest / pullmod.MARKER).exists()
    # with a correct manifest the same pull succeeds and records the digests
    right = hashlib.sha256((checkpoint / "tokenizer.json").read_bytes()).hexdigest()
    client.put_object(Bucket=BUCKET, Key="badsum/SHA256SUMS",
                      Body=f"{good}  config.json\n{right}  tokenizer.json\n".encode())
    r = run_pull(s3, f"s3://{BUCKET}/badsum", str(dest))
    assert r.returncode == 0, r.stderr
    marker = json.loads((dest / pullmod.MARKER).read_text())
    assert {f["path"]: f.get("sha256") for f in marker["files"]}["tokenizer.json"] == right


def test_wrong_keys_are_access_denied(s3: S3Server, uploaded: str, tmp_path: Path) -> None:
    for key, secret in ((s3.access_key, "not-the-secret"), ("nobody", s3.secret_key)):
        env = {**s3.env(), "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
        r = run_pull(s3, uploaded, str(tmp_path / "model"), env=env)
        assert r.returncode == pullmod.ExitCode.ACCESS_DENIED, r.stderr
        assert "access denied" in r.stderr and "AWS_SECRET_ACCESS_KEY" in r.stderr
    env = {k: v for k, v in s3.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    r = run_pull(s3, uploaded, str(tmp_path / "model"), env=env)
    assert r.returncode == pullmod.ExitCode.ACCESS_DENIED and "no S3 credentials" in r.stderr
    assert tree(tmp_path / "model") == {}


def test_missing_prefix_and_bucket_are_not_found(s3: S3Server, tmp_path: Path) -> None:
    r = run_pull(s3, f"s3://{BUCKET}/no-such-model", str(tmp_path / "a"))
    assert r.returncode == pullmod.ExitCode.NOT_FOUND
    assert f"no objects under s3://{BUCKET}/no-such-model/" in r.stderr
    r = run_pull(s3, "s3://no-such-bucket/x", str(tmp_path / "b"))
    assert r.returncode == pullmod.ExitCode.NOT_FOUND and "bucket 'no-such-bucket' does not exist" in r.stderr


def test_unreachable_endpoint_fails_after_retries(s3: S3Server, tmp_path: Path) -> None:
    with socket.socket() as s:      # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    r = run_pull(s3, f"s3://{BUCKET}/x", str(tmp_path / "m"), "--endpoint-url", f"http://127.0.0.1:{port}",
                 "--retries", "2")
    assert r.returncode == pullmod.ExitCode.UNREACHABLE, r.stderr
    assert f"cannot reach endpoint http://127.0.0.1:{port} after 3 attempts" in r.stderr
    assert time.monotonic() - t0 < 30


def test_disk_full_is_reported_before_downloading(s3: S3Server, uploaded: str, checkpoint: Path,
                                                  tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    total = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={total // 2}", "tmpfs", str(mnt)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs root to mount a small tmpfs: {mounted.stderr.decode().strip()}")
    try:
        r = run_pull(s3, uploaded, str(mnt / "model"))
        assert r.returncode == pullmod.ExitCode.DISK_FULL, r.stderr
        assert "disk full" in r.stderr and "MiB free" in r.stderr
        assert tree(mnt / "model") == {}
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_https_endpoint_with_private_ca(s3: S3Server, uploaded: str, checkpoint: Path, tmp_path: Path) -> None:
    assert s3.https_endpoint and s3.ca_file
    https = ("--endpoint-url", s3.https_endpoint)
    r = run_pull(s3, uploaded, str(tmp_path / "untrusted"), *https, "--retries", "0")
    assert r.returncode == pullmod.ExitCode.UNREACHABLE, r.stderr
    assert "TLS error" in r.stderr and "--ca-bundle" in r.stderr
    r = run_pull(s3, uploaded, str(tmp_path / "ca"), *https, "--ca-bundle", str(s3.ca_file))
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "ca") == tree(checkpoint)
    # AWS_CA_BUNDLE, the usual variable, works as well as the flag
    r = run_pull(s3, uploaded, str(tmp_path / "env"), *https, env={**s3.env(), "AWS_CA_BUNDLE": str(s3.ca_file)})
    assert r.returncode == 0, r.stderr
    r = run_pull(s3, uploaded, str(tmp_path / "insecure"), *https, "--no-verify-ssl")
    assert r.returncode == 0 and "not verified" in r.stderr, r.stderr
