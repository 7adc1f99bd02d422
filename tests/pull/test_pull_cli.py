"""`kvfleet pull` as a command: wiring into `kvfleet`, local sources, usage errors, staying light."""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvfleet_runtime import pull as pullmod
from support.s3 import S3Server

from pull.conftest import run_pull


def test_kvfleet_cli_runs_pull_with_its_exit_codes(s3: S3Server, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", "pull", "s3://no-such-bucket/m",
                           str(tmp_path / "m"), "--no-progress"], env=s3.env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == pullmod.ExitCode.NOT_FOUND, done.stderr
    assert "bucket 'no-such-bucket' does not exist" in done.stderr


def test_pull_module_does_not_import_torch() -> None:
    # The init container runs it: importing torch there costs seconds and GBs of page cache.
    done = subprocess.run([sys.executable, "-c", "import sys, kvfleet_runtime.pull; "
                           "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", \
        "importing kvfleet_runtime.pull loads " + done.stdout.strip() + " (kvfleet_runtime/__init__.py must import lazily)"


def test_local_folder_round_trip_and_skip(checkpoint: Path, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    r = run_pull(None, str(checkpoint), str(dest), "--chunk-size", "1M")
    assert r.returncode == 0, r.stderr
    for f in checkpoint.rglob("*"):
        if f.is_file():
            rel = f.relative_to(checkpoint)
            assert hashlib.sha256((dest / rel).read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest()
    r = run_pull(None, str(checkpoint), str(dest))
    assert r.returncode == 0 and "up to date" in r.stderr
    # a pulled folder can be pulled again elsewhere: our bookkeeping is not copied
    r = run_pull(None, str(dest), str(tmp_path / "copy"))
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "copy" / pullmod.STAGING).exists()
    assert sorted(p.name for p in (tmp_path / "copy").iterdir() if not p.name.startswith(".kvfleet")) == \
        sorted(p.name for p in checkpoint.iterdir())


@pytest.mark.parametrize("source, message", [
    ("gs://bucket/model", "SOURCE must be s3://bucket/prefix, hf://ORG/NAME[@REVISION] or a local folder; "
                          "got 'gs://bucket/model'"),
    ("s3:///model", "SOURCE must be s3://bucket/prefix"),
    ("hf://", "SOURCE must be hf://ORG/NAME[@REVISION]; got 'hf://'"),
    ("hf://org/name/extra", "SOURCE must be hf://ORG/NAME[@REVISION]; got 'hf://org/name/extra'"),
    ("hf://org/name@", "empty revision"),
])
def test_unsupported_sources_are_usage_errors(source: str, message: str, tmp_path: Path) -> None:
    r = run_pull(None, source, str(tmp_path / "m"))
    assert r.returncode == pullmod.ExitCode.USAGE and message in r.stderr, r.stderr


def test_include_and_exclude_choose_files_of_a_local_folder(checkpoint: Path, tmp_path: Path) -> None:
    r = run_pull(None, str(checkpoint), str(tmp_path / "a"), "--exclude", "*.safetensors", "--exclude", "tokenizer*")
    assert r.returncode == 0, r.stderr
    assert "matched by --exclude" in r.stderr
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith(".kvfleet")) == \
        sorted(p.name for p in checkpoint.iterdir() if not p.name.endswith(".safetensors")
               and not p.name.startswith("tokenizer"))
    r = run_pull(None, str(checkpoint), str(tmp_path / "b"), "--include", "*.json")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if not p.name.startswith(".kvfleet")) == \
        sorted(p.name for p in checkpoint.iterdir() if p.name.endswith(".json"))
    # the Hub's default (safetensors only) is not applied to a folder the user filled
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"st")
    (src / "extra.bin").write_bytes(b"bin")
    assert run_pull(None, str(src), str(tmp_path / "c")).returncode == 0
    assert (tmp_path / "c" / "extra.bin").read_bytes() == b"bin"


def test_missing_local_folder_is_not_found(tmp_path: Path) -> None:
    r = run_pull(None, str(tmp_path / "nothing"), str(tmp_path / "m"))
    assert r.returncode == pullmod.ExitCode.NOT_FOUND and "does not exist" in r.stderr


def test_sizes_parse_with_units() -> None:
    assert pullmod.parse_size("16M") == 16 << 20
    assert pullmod.parse_size("16MiB") == 16 << 20
    assert pullmod.parse_size("512k") == 512 << 10
    assert pullmod.parse_size("1.5G") == 3 << 29
    assert pullmod.parse_size("100") == 100
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size like 16M"):
        pullmod.parse_size("lots")


@pytest.mark.parametrize("key", ["../evil.txt", "a/../../evil.txt", "/etc/evil", ""])
def test_source_paths_escaping_dest_are_refused(key: str) -> None:
    # SeaweedFS refuses such keys on upload; other S3 servers store them verbatim.
    with pytest.raises(pullmod.PullError, match="would land outside DEST") as e:
        pullmod.safe_relpath(key)
    assert e.value.code == pullmod.ExitCode.VERIFY_FAILED
    assert pullmod.safe_relpath("sub/model.safetensors") == "sub/model.safetensors"


def test_progress_is_logged_as_lines_without_a_terminal(checkpoint: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    pullmod.pull(str(checkpoint), tmp_path / "m", pullmod.PullOptions(chunk_size=1 << 20, log_interval=0.0))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvfleet pull: ")]
    assert lines and all(re.fullmatch(r"kvfleet pull: \d+ of \d+ MiB \(\d+%\), [\d.]+ MiB/s", ln) for ln in lines)
    assert "\r" not in "".join(lines)


def test_a_new_manifest_also_checks_the_files_kept_from_the_last_pull(tmp_path: Path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    assert run_pull(None, str(src), str(dest)).returncode == 0
    good = hashlib.sha256(b"weights").hexdigest()
    (src / "SHA256SUMS").write_text(f"{'0' * 64}  model.safetensors\n")
    r = run_pull(None, str(src), str(dest))
    assert r.returncode == pullmod.ExitCode.VERIFY_FAILED and "model.safetensors does not match" in r.stderr
    (src / "SHA256SUMS").write_text(f"{good}  model.safetensors\n")
    r = run_pull(None, str(src), str(dest))
    assert r.returncode == 0, r.stderr
    assert (dest / "SHA256SUMS").exists()
