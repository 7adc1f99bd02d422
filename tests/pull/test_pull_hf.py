"""`kvfleet pull hf://ORG/NAME[@REVISION]` against a stand-in of the Hugging Face Hub (tests/support/hub.py:
the Hub itself cannot be reached from CI). Every pull is the real command in its own process."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from kvfleet_runtime import pull as pullmod
from support.hub import HubServer, folder_files

from pull.conftest import pull_process, run_pull_process, tree, wait_for_chunks

REPO = "kvfleet-test/tiny-llama"


def digests(files: dict[str, bytes]) -> dict[str, str]:
    return {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}


def marker(dest: Path) -> dict:
    return json.loads((dest / pullmod.MARKER).read_text())


def small_repo(hub: HubServer, repo_id: str = REPO, **kwargs: object) -> tuple[str, dict[str, bytes]]:
    """config.json, a 2-shard safetensors model (LFS) and a tokenizer.json (not LFS)."""
    files = {
        "config.json": b'{"model_type": "llama", "v": 1}',
        "model-00001-of-00002.safetensors": os.urandom(1 << 20),
        "model-00002-of-00002.safetensors": os.urandom(1 << 20),
        "tokenizer.json": json.dumps({"model": {"vocab": {f"t{i}": i for i in range(3000)}}}).encode(),
    }
    return hub.create_repo(repo_id, files, **kwargs), files


def fetched_paths(hub: HubServer, repo_id: str = REPO) -> set[str]:
    """Repo files whose bytes were asked for (the LFS ones through their resolve redirect)."""
    return {r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in hub.file_requests()
            if r.path.startswith(f"/{repo_id}/resolve/")}


def test_whole_repo_round_trip_leaves_other_weight_formats_out(hub: HubServer, checkpoint: Path,
                                                               tmp_path: Path) -> None:
    model = folder_files(checkpoint)
    decoys = {"pytorch_model.bin": os.urandom(300_000), "original/consolidated.00.pth": os.urandom(500_000),
              "original/params.json": b'{"dim": 64}'}
    draft = {"draft/config.json": model["config.json"], "draft/tokenizer.json": model["tokenizer.json"],
             "draft/tokenizer_config.json": model["tokenizer_config.json"]}
    sha = hub.create_repo(REPO, {**model, **decoys, **draft})
    dest = tmp_path / "model"
    r = run_pull_process(hub, f"hf://{REPO}", str(dest), "--chunk-size", "1M", "--jobs", "8")
    assert r.returncode == 0, r.stderr
    assert tree(dest) == digests({**model, **draft})
    assert len(list(dest.glob("model-*.safetensors"))) >= 3, "the fixture should be sharded"
    assert "leaving out 4 of" in r.stderr
    for name in (".gitattributes", "pytorch_model.bin", "original/consolidated.00.pth", "original/params.json"):
        assert name in r.stderr
    assert f"from hf://{REPO}@{sha}" in r.stderr
    assert not (dest / pullmod.STAGING).exists()
    m = marker(dest)
    assert m["source"] == f"hf://{REPO}" and m["commit"] == sha
    lfs = {f["path"] for f in m["files"] if "sha256" in f}
    assert lfs == {p for p in model if p.endswith(".safetensors")}
    assert all("blob_id" in f for f in m["files"] if f["path"] not in lfs)
    # LFS bytes came through the CDN redirect, the others straight from resolve/
    assert any(r.path.startswith("/cdn/") for r in hub.file_requests())
    from transformers import AutoConfig, AutoTokenizer
    assert AutoConfig.from_pretrained(dest).model_type == "llama"
    assert AutoTokenizer.from_pretrained(dest).encode("hello")


def test_include_and_exclude_choose_the_files(hub: HubServer, tmp_path: Path) -> None:
    _, files = small_repo(hub)
    hub.push(REPO, {"pytorch_model.bin": b"pickle" * 100, "original/params.json": b"{}", "README.md": b"# tiny"})

    def pulled(*flags: str, dest: str = "m") -> set[str]:
        r = run_pull_process(hub, f"hf://{REPO}", str(tmp_path / dest), *flags)
        assert r.returncode == 0, r.stderr
        return set(tree(tmp_path / dest))

    # --include replaces the default choice, so it can ask for what the default leaves out
    assert pulled("--include", "*.json", dest="json") == {"config.json", "tokenizer.json", "original/params.json"}
    assert pulled("--include", "*.bin", "--include", "config.json", dest="bin") == {"pytorch_model.bin",
                                                                                    "config.json"}
    # --exclude narrows the default
    assert pulled("--exclude", "*.md", "--exclude", "tokenizer.*", dest="ex") == {
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    # pulling a narrower choice into the same DEST removes what is no longer chosen
    assert pulled("--include", "config.json", dest="ex") == {"config.json"}
    r = run_pull_process(hub, f"hf://{REPO}", str(tmp_path / "none"), "--include", "*.gguf")
    assert r.returncode == pullmod.ExitCode.USAGE
    assert "--include/--exclude leave none of the 8 files" in r.stderr


def test_a_repo_without_model_files_is_not_found(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo(REPO, {})
    r = run_pull_process(hub, f"hf://{REPO}", str(tmp_path / "m"))
    assert r.returncode == pullmod.ExitCode.NOT_FOUND
    assert f"hf://{REPO} has no files to pull (only .gitattributes)" in r.stderr


def test_revision_by_branch_tag_and_commit(hub: HubServer, tmp_path: Path) -> None:
    first, files = small_repo(hub)
    hub.tag(REPO, "v1.0", first)
    second = hub.push(REPO, {"config.json": b'{"v": 2}'})
    pr = hub.push(REPO, {"config.json": b'{"v": "pr"}'}, branch="refs/pr/1")
    for revision, commit, config in (("", second, b'{"v": 2}'), ("@main", second, b'{"v": 2}'),
                                     ("@v1.0", first, files["config.json"]),
                                     (f"@{first}", first, files["config.json"]),
                                     ("@refs/pr/1", pr, b'{"v": "pr"}')):
        dest = tmp_path / (revision.strip("@").replace("/", "-") or "default")
        r = run_pull_process(hub, f"hf://{REPO}{revision}", str(dest))
        assert r.returncode == 0, (revision, r.stderr)
        assert (dest / "config.json").read_bytes() == config, revision
        assert marker(dest)["commit"] == commit, revision
    r = run_pull_process(hub, f"hf://{REPO}@no-such-branch", str(tmp_path / "nope"))
    assert r.returncode == pullmod.ExitCode.NOT_FOUND
    assert f"revision 'no-such-branch' not found in '{REPO}'" in r.stderr


def test_a_bare_repo_name_is_pulled(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("gpt2", {"config.json": b"{}", "model.safetensors": b"\0" * 1000})
    r = run_pull_process(hub, "hf://gpt2", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert set(tree(tmp_path / "m")) == {"config.json", "model.safetensors"}


def test_a_branch_moving_mid_pull_does_not_mix_commits(hub: HubServer, tmp_path: Path) -> None:
    first, files = small_repo(hub)
    # the branch moves right after the pull has listed it: every file changes
    hub.after_listing = lambda: hub.push(REPO, {p: os.urandom(len(d)) for p, d in files.items()})
    dest = tmp_path / "model"
    r = run_pull_process(hub, f"hf://{REPO}", str(dest), "--chunk-size", "1M")
    assert r.returncode == 0, r.stderr
    assert hub.repos[REPO].refs["main"] != first
    assert tree(dest) == digests(files)
    assert marker(dest)["commit"] == first
    resolves = [r.path for r in hub.file_requests() if "/resolve/" in r.path]
    assert resolves and all(p.startswith(f"/{REPO}/resolve/{first}/") for p in resolves)


def test_resume_after_a_killed_pull(hub: HubServer, tmp_path: Path) -> None:
    blob = os.urandom(8 << 20)
    hub.create_repo(REPO, {"config.json": b"{}", "model.safetensors": blob})
    hub.stall("model.safetensors", 3 << 20)    # the server stops sending from 3 MiB on
    dest = tmp_path / "model"
    state = dest / pullmod.STAGING / "model.safetensors.part.json"
    proc = pull_process(hub, f"hf://{REPO}", str(dest), "--chunk-size", "1M", "--jobs", "2")
    wait_for_chunks(proc, state, 3)
    os.kill(proc.pid, signal.SIGKILL)   # OOM, node loss: no chance to clean up
    proc.wait()
    assert not (dest / "model.safetensors").exists() and not (dest / pullmod.MARKER).exists()
    hub.release()
    r = run_pull_process(hub, f"hf://{REPO}", str(dest), "--chunk-size", "1M")
    assert r.returncode == 0, r.stderr
    assert (dest / "model.safetensors").read_bytes() == blob
    resumed = float(r.stderr.split("resumed ")[1].split(" MiB")[0])
    assert resumed >= 3, r.stderr


@pytest.mark.parametrize("path, problem", [("model-00002-of-00002.safetensors", "sha256"),
                                           ("tokenizer.json", "git blob id")])
def test_corrupt_bytes_fail_verification_and_install_nothing(hub: HubServer, tmp_path: Path, path: str,
                                                             problem: str) -> None:
    small_repo(hub)
    hub.corrupt.add(path)
    dest = tmp_path / "model"
    r = run_pull_process(hub, f"hf://{REPO}", str(dest))
    assert r.returncode == pullmod.ExitCode.VERIFY_FAILED, r.stderr
    assert f"{path}: {problem}" in r.stderr and "fetching it again" in r.stderr      # one retry from scratch
    assert f"{path} does not match the source: {problem}" in r.stderr and "nothing was installed" in r.stderr
    assert tree(dest) == {}, "nothing may reach DEST when a file fails verification"
    assert not (dest / pullmod.MARKER).exists()
    hub.corrupt.clear()
    r = run_pull_process(hub, f"hf://{REPO}", str(dest))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kind, token, code, message", [
    ("missing", None, "NOT_FOUND", "or it is private: set HF_TOKEN"),
    ("private", None, "NOT_FOUND", "or it is private: set HF_TOKEN"),
    ("private", "hf_other", "NOT_FOUND", "or the token in HF_TOKEN cannot read it"),
    ("private", "hf_granted", "OK", ""),
    ("gated", None, "ACCESS_DENIED", "is gated: accept its license on"),
    ("gated", "hf_other", "ACCESS_DENIED", "HF_TOKEN holds a token that has not been granted access"),
    ("gated", "hf_granted", "OK", ""),
    ("public", "hf_revoked", "ACCESS_DENIED", "check HF_TOKEN"),
])
def test_private_gated_and_missing_repos(hub: HubServer, tmp_path: Path, kind: str, token: str | None, code: str,
                                         message: str) -> None:
    if kind != "missing":
        small_repo(hub, private=kind == "private", gated=kind == "gated", tokens=("hf_granted",))
    hub.add_token("hf_other")
    dest = tmp_path / "model"
    r = run_pull_process(hub, f"hf://{REPO}", str(dest), env=hub.env(token=token))
    assert r.returncode == pullmod.ExitCode[code], r.stderr
    assert message in r.stderr
    if code == "OK":
        assert len(tree(dest)) == 4
        return
    assert "hf_" not in r.stderr, "a token must never reach the logs"
    if kind == "gated":
        assert f"accept its license on {hub.url}/{REPO}" in r.stderr
        assert token is not None or "no token was sent: set HF_TOKEN" in r.stderr
    # refused before any disk space was reserved or byte fetched
    assert not (dest / pullmod.STAGING).exists() and tree(dest) == {}


def test_unreachable_endpoint_fails_after_retries(hub: HubServer, tmp_path: Path) -> None:
    with socket.socket() as s:      # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**hub.env(), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    t0 = time.monotonic()
    r = run_pull_process(hub, f"hf://{REPO}", str(tmp_path / "m"), "--retries", "2", env=env)
    assert r.returncode == pullmod.ExitCode.UNREACHABLE, r.stderr
    assert f"cannot reach the Hub at http://127.0.0.1:{port} after 3 attempts" in r.stderr
    assert time.monotonic() - t0 < 30


def test_server_errors_are_retried(hub: HubServer, tmp_path: Path) -> None:
    _, files = small_repo(hub)
    hub.fail_next(3)                                   # the listing fails three times
    hub.after_listing = lambda: hub.fail_next(3)       # then three file reads
    r = run_pull_process(hub, f"hf://{REPO}", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "m") == {p: d for p, d in digests(files).items()}
    assert [r.status for r in hub.requests].count(500) == 6
    # a server that keeps failing: UNREACHABLE after the retries
    hub.fail_next(100)
    r = run_pull_process(hub, f"hf://{REPO}", str(tmp_path / "n"), "--retries", "1")
    assert r.returncode == pullmod.ExitCode.UNREACHABLE, r.stderr
    assert "after 2 attempts: HTTP 500" in r.stderr


def test_hf_hub_offline_is_a_usage_error(hub: HubServer, tmp_path: Path) -> None:
    small_repo(hub)
    r = run_pull_process(hub, f"hf://{REPO}", str(tmp_path / "m"), env={**hub.env(), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == pullmod.ExitCode.USAGE and "set HF_HUB_OFFLINE=0" in r.stderr, r.stderr
    r = run_pull_process(hub, f"hf://{REPO}", str(tmp_path / "m"), env={**hub.env(), "HF_HUB_OFFLINE": "0",
                                                                          "TRANSFORMERS_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr


def test_repull_of_the_same_commit_fetches_nothing(hub: HubServer, tmp_path: Path) -> None:
    small_repo(hub)
    dest = tmp_path / "model"
    assert run_pull_process(hub, f"hf://{REPO}", str(dest)).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file() and p.name != pullmod.LOCK}
    hub.requests.clear()
    r = run_pull_process(hub, f"hf://{REPO}", str(dest))
    assert r.returncode == 0 and "up to date" in r.stderr, r.stderr
    assert [(q.method, q.path) for q in hub.requests if q.path != "/api/agent-harnesses"] == \
        [("GET", f"/api/models/{REPO}/revision/main")]
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file() and p.name != pullmod.LOCK} == before


def test_a_new_commit_fetches_only_the_changed_files(hub: HubServer, tmp_path: Path) -> None:
    first, files = small_repo(hub)
    hub.push(REPO, {"notes.txt": b"stale"})
    dest = tmp_path / "model"
    assert run_pull_process(hub, f"hf://{REPO}", str(dest)).returncode == 0
    changed = {"config.json": b'{"model_type": "llama", "v": 2}', "model-00002-of-00002.safetensors": os.urandom(1 << 20)}
    second = hub.push(REPO, {**changed, "notes.txt": None})
    hub.requests.clear()
    r = run_pull_process(hub, f"hf://{REPO}", str(dest))
    assert r.returncode == 0, r.stderr
    assert fetched_paths(hub) == set(changed)
    assert tree(dest) == digests({**files, **changed})
    assert not (dest / "notes.txt").exists()
    assert marker(dest)["commit"] == second
    # a commit touching only files the pull leaves out: nothing to fetch, the marker names the new commit
    third = hub.push(REPO, {"pytorch_model.bin": b"pickle"})
    hub.requests.clear()
    r = run_pull_process(hub, f"hf://{REPO}", str(dest))
    assert r.returncode == 0 and "up to date" in r.stderr, r.stderr
    assert fetched_paths(hub) == set() and marker(dest)["commit"] == third
    assert first not in (second, third)
