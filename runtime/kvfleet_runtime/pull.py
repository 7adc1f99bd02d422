"""`kvfleet pull SOURCE DEST`: copy a model folder from S3, the Hugging Face Hub (or a local folder) into DEST.

Sources: `s3://bucket/prefix`, `hf://ORG/NAME[@REVISION]` (a model repo on the
Hub or the mirror $HF_ENDPOINT names; REVISION a branch, tag or commit, default
main; token from $HF_TOKEN) and a local folder.

This module owns the whole pull: listing the source, choosing its files
(--include/--exclude; a Hub repo with safetensors weights leaves its other weight
formats and original/ out), parallel ranged downloads, resume after interruption,
verification (size; S3 ETag; the Hub's LFS sha256 or git blob id; and a
`SHA256SUMS` manifest when the source has one), the atomic hand-over into DEST
and the completion marker, and the mapping of every failure to an exit code.

Every file is fetched at one version: an S3 object at the ETag it was listed
with (If-Match), a Hub file at the commit the revision named when it was listed,
so a push during the pull cannot mix two commits. "Unchanged" is judged by
content (ETag, sha256, blob id), so a new commit re-fetches only changed files.

It runs as the LLMService init container, so it must stay light: boto3,
huggingface_hub (imported by the source that needs it) and tqdm only, no torch
(tests/pull/test_pull_cli.py pins that).

On-disk contract inside DEST:
  .kvfleet-pull.partial/<path>.part       bytes being fetched (never loaded by the runtime)
  .kvfleet-pull.partial/<path>.part.json  its finished chunks and their MD5s (the resume state)
  .kvfleet-pull.json                      completion marker, written last: source (+ commit) + files
  .kvfleet-pull.lock                      flock()ed while a pull runs (replicas sharing a volume)
A file reaches its real name only after it is complete and verified, and the
marker is written only after every file has.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

T = TypeVar("T")

MARKER = ".kvfleet-pull.json"
STAGING = ".kvfleet-pull.partial"
LOCK = ".kvfleet-pull.lock"
MANIFEST = "SHA256SUMS"
# Names of our own bookkeeping; never copied from a source folder that was itself pulled.
RESERVED = {MARKER, STAGING, LOCK}
PIECE = 1 << 20     # bytes read from a response body at a time
MiB = 1 << 20
# What a Hub repo with *.safetensors weights also carries for other frameworks (PyTorch pickles, TF,
# Flax, ONNX, GGUF, Core ML) and Meta's original checkpoint (original/consolidated.00.pth, 16 GB for
# Llama 3 8B): the server loads none of them. vLLM downloads only *.safetensors in that case too.
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "*.onnx", "*.onnx_data", "*.ot",
                 "*.tflite", "*.gguf", "*.mlmodel", "*.mlpackage/*", "original/*")
# HTTP statuses worth another try (huggingface_hub's http_backoff retries the same ones).
TRANSIENT_STATUSES = (408, 429, 500, 502, 503, 504)


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    NOT_FOUND = 3
    ACCESS_DENIED = 4
    UNREACHABLE = 5
    DISK_FULL = 6
    VERIFY_FAILED = 7
    INTERRUPTED = 130


class PullError(Exception):
    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RemoteFile:
    path: str           # relative to the source root, posix separators
    size: int
    etag: str | None    # S3 ETag without quotes; None for local and Hub files
    fingerprint: str    # what "unchanged" means: the ETag, a Hub file's sha256 or blob id, or size and mtime
    sha256: str | None = None    # the source's own digest of the bytes (a Hub LFS file's)
    blob_id: str | None = None   # git blob id, sha1 of b"blob <size>\0" + bytes (a Hub file not in LFS)


@dataclass
class PullOptions:
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str | None = None   # None: path with a custom endpoint, else auto
    verify_ssl: bool = True
    ca_bundle: str | None = None
    jobs: int = 16
    chunk_size: int = 16 * MiB
    retries: int = 5
    max_bandwidth: int | None = None      # bytes per second over all connections
    progress: bool | None = None          # None: a bar on a terminal, else a log line now and then
    log_interval: float = 10.0            # seconds between those log lines (container logs)
    include: tuple[str, ...] = ()         # globs: only files matching one (replaces the Hub default)
    exclude: tuple[str, ...] = ()         # globs: never files matching one


@dataclass
class PullResult:
    source: str
    dest: Path
    files: int
    bytes_total: int
    bytes_fetched: int
    bytes_resumed: int
    seconds: float
    up_to_date: bool = False
    commit: str | None = None     # the Hub commit pulled


# ---------------------------------------------------------------- sources


class LocalSource:
    """A folder on a local or mounted filesystem."""

    commit: str | None = None    # no versions: a file is pinned by its size and mtime

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def list_files(self) -> list[RemoteFile]:
        if not self.root.is_dir():
            raise PullError(f"source folder {self.root} does not exist", ExitCode.NOT_FOUND)
        files = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d not in RESERVED)
            for name in sorted(filenames):
                if name in RESERVED:
                    continue
                full = Path(dirpath) / name
                st = full.stat()
                rel = full.relative_to(self.root).as_posix()
                files.append(RemoteFile(rel, st.st_size, None, f"{st.st_size}:{st.st_mtime_ns}"))
        return files

    def read_range(self, f: RemoteFile, start: int, end: int) -> Iterator[bytes]:
        with open(self.root / f.path, "rb") as fh:
            fh.seek(start)
            remaining = end - start
            while remaining:
                piece = fh.read(min(PIECE, remaining))
                if not piece:
                    raise PullError(f"{self.root / f.path} shrank while being copied", ExitCode.VERIFY_FAILED)
                remaining -= len(piece)
                yield piece



class S3Source:
    """`s3://bucket/prefix`: everything under prefix/, fetched with ranged GETs pinned to the listed ETag."""

    commit: str | None = None    # no versions: each object is pinned by its own ETag

    def __init__(self, bucket: str, prefix: str, options: PullOptions) -> None:
        import boto3  # lazily: local pulls need no boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        style = options.addressing_style or ("path" if self.endpoint else "auto")
        region = (options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))
        session = boto3.session.Session(region_name=region)
        if session.region_name is None:
            session = boto3.session.Session(region_name="us-east-1")
        # None lets botocore read $AWS_CA_BUNDLE and the config file's ca_bundle.
        verify: bool | str | None = options.ca_bundle or None
        if not options.verify_ssl:
            verify = False
            import urllib3

            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
            print("kvfleet pull: warning: TLS certificates are not verified (--no-verify-ssl)", file=sys.stderr)
        self.attempts = options.retries + 1
        self.client = session.client(
            "s3",
            endpoint_url=self.endpoint,
            verify=verify,
            config=Config(
                s3={"addressing_style": style},
                # botocore's standard mode retries connection errors, throttling and 5xx
                # with exponential backoff and jitter before we ever see an exception.
                retries={"max_attempts": self.attempts, "mode": "standard"},
                max_pool_connections=options.jobs + 4,
                connect_timeout=10,
                read_timeout=60,
            ),
        )

    def where(self) -> str:
        return f"endpoint {self.endpoint}" if self.endpoint else "AWS S3"

    def list_files(self) -> list[RemoteFile]:
        files = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(self.prefix):]
                    if not rel or rel.endswith("/"):     # folder placeholder objects
                        continue
                    etag = obj["ETag"].strip('"')
                    files.append(RemoteFile(rel, obj["Size"], etag, etag))
        except Exception as e:
            raise self.error(e, f"listing {self.url}") from e
        if not files:
            raise PullError(f"no objects under {self.url} at {self.where()} (the bucket exists; check the prefix)",
                            ExitCode.NOT_FOUND)
        return files

    def read_range(self, f: RemoteFile, start: int, end: int) -> Iterator[bytes]:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self.prefix + f.path,
                                          Range=f"bytes={start}-{end - 1}", IfMatch=f'"{f.etag}"')
            yield from resp["Body"].iter_chunks(PIECE)
        except PullError:
            raise
        except Exception as e:
            raise self.error(e, f"reading {self.url}{f.path}") from e

    def part_size(self, f: RemoteFile) -> int | None:
        """Size of part 1 of a multipart upload, which the multipart ETag depends on."""
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.prefix + f.path, PartNumber=1)
        except Exception as e:
            raise self.error(e, f"reading {self.url}{f.path}") from e
        return head["ContentLength"] if head.get("PartsCount") else None

    def error(self, e: Exception, doing: str) -> PullError | Exception:
        """Map a boto3 exception to a PullError with an exit code; transient ones stay as they are."""
        from botocore import exceptions as bx

        if isinstance(e, bx.NoCredentialsError):
            return PullError(f"{doing}: no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                             "(or AWS_PROFILE / a credentials file)", ExitCode.ACCESS_DENIED)
        if isinstance(e, bx.SSLError):
            return PullError(f"{doing}: TLS error talking to {self.where()}: {e}; pass --ca-bundle PATH for a "
                             "private CA (or --no-verify-ssl)", ExitCode.UNREACHABLE)
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
            return PullError(f"{doing}: cannot reach {self.where()} after {self.attempts} attempts: {e}",
                             ExitCode.UNREACHABLE)
        if isinstance(e, bx.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                return PullError(f"{doing}: bucket '{self.bucket}' does not exist at {self.where()}",
                                 ExitCode.NOT_FOUND)
            if code in ("NoSuchKey", "404", "NotFound"):
                return PullError(f"{doing}: no such key at {self.where()}", ExitCode.NOT_FOUND)
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                        "ExpiredToken", "InvalidToken", "InvalidClientTokenId"):
                return PullError(f"{doing}: access denied by {self.where()} ({code}); check AWS_ACCESS_KEY_ID / "
                                 "AWS_SECRET_ACCESS_KEY and the bucket policy", ExitCode.ACCESS_DENIED)
            if code in ("PreconditionFailed", "412"):
                return PullError(f"{doing}: the object changed during the pull (its ETag is no longer the listed "
                                 "one); run the pull again", ExitCode.VERIFY_FAILED)
            return PullError(f"{doing}: S3 error {code}: {e}", ExitCode.FAILED)
        return e


class HfSource:
    """`hf://ORG/NAME[@REVISION]`: a model repo on the Hugging Face Hub, or the mirror $HF_ENDPOINT names.

    The listing resolves REVISION to its commit once; every file is then fetched at
    that commit (the analogue of the S3 source's ETag pinning). LFS files answer with
    a redirect to a CDN, which the session follows with the Range header kept. The
    token is huggingface_hub's: $HF_TOKEN (or a token file under $HF_HOME).
    """

    def __init__(self, repo_id: str, revision: str, options: PullOptions) -> None:
        import httpx2
        from huggingface_hub import HfApi, constants, get_token
        from huggingface_hub.utils import build_hf_headers

        self.repo_id = repo_id
        self.revision = revision
        self.url = f"hf://{repo_id}"     # no revision: files of another commit count as unchanged by content
        self.commit: str | None = None
        self.endpoint = constants.ENDPOINT
        self.has_token = get_token() is not None
        self.api = HfApi()
        # Accept-Encoding identity: a Range counts bytes of the file, not of a gzipped body.
        self.headers = {**build_hf_headers(), "Accept-Encoding": "identity"}
        self.attempts = options.retries + 1
        self.timeout = httpx2.Timeout(60.0, connect=10.0)

    def list_files(self) -> list[RemoteFile]:
        doing = f"listing {self.url}@{self.revision}"
        info = self._with_retries(lambda: self.api.model_info(
            self.repo_id, revision=self.revision, files_metadata=True, timeout=60), doing)
        self.commit = info.sha
        files = []
        for s in info.siblings or []:
            if s.lfs is not None:
                files.append(RemoteFile(s.rfilename, s.lfs.size, None, f"sha256:{s.lfs.sha256}",
                                        sha256=s.lfs.sha256))
            elif s.size is not None:
                files.append(RemoteFile(s.rfilename, s.size, None, f"blob:{s.blob_id}", blob_id=s.blob_id))
            else:
                raise PullError(f"{doing}: {self.where()} lists {s.rfilename} without its size (a mirror without "
                                "the ?blobs=true listing?)", ExitCode.FAILED)
        if not self.commit or not files:
            raise PullError(f"{doing}: {self.where()} lists no commit or no files", ExitCode.NOT_FOUND)
        if info.gated:
            # The listing of a gated repo is public, its files are not: ask for one now rather than
            # after reserving disk space for all of them.
            self._check_file_access(min(files, key=lambda f: (f.path in (".gitattributes", "README.md"), f.size)))
        return files

    def _check_file_access(self, f: RemoteFile) -> None:
        from huggingface_hub import get_hf_file_metadata

        self._with_retries(lambda: get_hf_file_metadata(self.file_url(f), timeout=60),
                           f"reading {self.url}/{f.path}")

    def file_url(self, f: RemoteFile) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, f.path, revision=self.commit)

    def read_range(self, f: RemoteFile, start: int, end: int) -> Iterator[bytes]:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        try:
            headers = {**self.headers, "Range": f"bytes={start}-{end - 1}"}
            with get_session().stream("GET", self.file_url(f), headers=headers, timeout=self.timeout) as r:
                hf_raise_for_status(r)
                whole = r.status_code == 200 and (start, end) == (0, f.size)
                if not whole and not (r.status_code == 206 and r.headers.get("Content-Range", "").startswith(
                        f"bytes {start}-{end - 1}/")):
                    raise PullError(f"reading {self.url}/{f.path}: asked {self.where()} for bytes {start}-{end - 1}, "
                                    f"got HTTP {r.status_code} Content-Range {r.headers.get('Content-Range')!r}",
                                    ExitCode.FAILED)
                yield from r.iter_raw(PIECE)
        except PullError:
            raise
        except Exception as e:
            mapped = self.error(e, f"reading {self.url}/{f.path} at commit {self.commit}")
            if mapped is not e:
                raise mapped from e
            if self.transient(e) and not isinstance(e, ConnectionError):
                # Transfer retries it; a short message for the last attempt's error
                raise ConnectionError(f"{self.where()} answered {self.describe(e)}") from e
            raise

    def where(self) -> str:
        return f"the Hub at {self.endpoint}"

    def _with_retries(self, call: Callable[[], T], doing: str) -> T:
        """`call()`, again after transient failures (connection errors, 5xx, 429), like Transfer's chunks."""
        attempt = 0
        while True:
            try:
                return call()
            except Exception as e:
                mapped = self.error(e, doing)
                if mapped is not e:
                    raise mapped from e
                if not self.transient(e):
                    raise
                attempt += 1
                if attempt == self.attempts:
                    raise PullError(f"{doing}: cannot reach {self.where()} after {self.attempts} attempts: "
                                    f"{self.describe(e)}", ExitCode.UNREACHABLE) from e
                time.sleep(backoff(attempt - 1))

    @staticmethod
    def transient(e: Exception) -> bool:
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(e, HfHubHTTPError):
            return e.response is not None and e.response.status_code in TRANSIENT_STATUSES
        return isinstance(e, httpx2.TransportError)

    @staticmethod
    def describe(e: Exception) -> str:
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(e, HfHubHTTPError) and e.response is not None:
            return f"HTTP {e.response.status_code}" + (f" ({e.server_message})" if e.server_message else "")
        return f"{type(e).__name__}: {e}"

    def error(self, e: Exception, doing: str) -> PullError | Exception:
        """Map a huggingface_hub exception to a PullError with an exit code; transient ones stay as they are."""
        from huggingface_hub import errors as hx

        repo = f"{self.repo_id!r} at {self.where()}"
        if isinstance(e, hx.OfflineModeIsEnabled):
            return PullError(f"{doing}: offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); set "
                             f"HF_HUB_OFFLINE=0 to pull from {self.where()}", ExitCode.USAGE)
        if isinstance(e, hx.GatedRepoError):
            how = ("HF_TOKEN holds a token that has not been granted access" if self.has_token
                   else "no token was sent: set HF_TOKEN to a read token of that account")
            return PullError(f"{doing}: {repo} is gated: accept its license on {self.endpoint}/{self.repo_id} "
                             f"with your Hugging Face account; {how}", ExitCode.ACCESS_DENIED)
        if isinstance(e, hx.RepositoryNotFoundError):
            how = ("or the token in HF_TOKEN cannot read it" if self.has_token
                   else "or it is private: set HF_TOKEN to a token that can read it")
            return PullError(f"{doing}: repository {repo} not found (check ORG/NAME, {how})", ExitCode.NOT_FOUND)
        if isinstance(e, hx.RevisionNotFoundError):
            return PullError(f"{doing}: revision {self.revision!r} not found in {repo} (a branch, tag or commit "
                             "sha)", ExitCode.NOT_FOUND)
        if isinstance(e, hx.RemoteEntryNotFoundError):
            return PullError(f"{doing}: the file is gone from {repo}", ExitCode.NOT_FOUND)
        if isinstance(e, hx.HfHubHTTPError) and e.response is not None and not self.transient(e):
            status = e.response.status_code
            if status in (401, 403):
                return PullError(f"{doing}: {self.where()} refused access ({self.describe(e)}); check HF_TOKEN",
                                 ExitCode.ACCESS_DENIED)
            return PullError(f"{doing}: {self.where()} answered {self.describe(e)}", ExitCode.FAILED)
        return e


Source = LocalSource | S3Source | HfSource


def open_source(source: str, options: PullOptions) -> Source:
    if source.startswith("s3://"):
        bucket, _, prefix = source[len("s3://"):].partition("/")
        if not bucket:
            raise PullError(f"SOURCE must be s3://bucket/prefix; got {source!r}", ExitCode.USAGE)
        return S3Source(bucket, prefix, options)
    if source.startswith("hf://"):
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        repo_id, at, revision = source[len("hf://"):].partition("@")
        try:
            validate_repo_id(repo_id)
        except HFValidationError as e:
            raise PullError(f"SOURCE must be hf://ORG/NAME[@REVISION]; got {source!r}: {e}", ExitCode.USAGE) from e
        if at and not revision:
            raise PullError(f"SOURCE must be hf://ORG/NAME[@REVISION]; got {source!r}: empty revision",
                            ExitCode.USAGE)
        return HfSource(repo_id, revision or "main", options)
    if re.match(r"^[a-z][a-z0-9+.-]*://", source):
        raise PullError(f"SOURCE must be s3://bucket/prefix, hf://ORG/NAME[@REVISION] or a local folder; "
                        f"got {source!r}", ExitCode.USAGE)
    return LocalSource(Path(source))


def select_files(src: Source, files: list[RemoteFile], options: PullOptions) -> list[RemoteFile]:
    """The files to pull. Globs match like huggingface-cli download's (fnmatch: `*` crosses `/`).
    --include replaces the default choice; --exclude narrows whichever applies. A Hub repo's
    .gitattributes is never pulled, and with *.safetensors weights neither are OTHER_WEIGHTS."""
    hub = isinstance(src, HfSource)
    safetensors_only = hub and not options.include and any(fnmatchcase(f.path, "*.safetensors") for f in files)
    chosen, reasons, left_out = [], {}, []
    for f in files:
        if hub and PurePosixPath(f.path).name == ".gitattributes":
            reason = "git metadata"
        elif options.include and not any(fnmatchcase(f.path, g) for g in options.include):
            reason = "not matched by --include"
        elif any(fnmatchcase(f.path, g) for g in options.exclude):
            reason = "matched by --exclude"
        elif safetensors_only and any(fnmatchcase(f.path, g) for g in OTHER_WEIGHTS):
            reason = "weights beside *.safetensors the server does not load (--include GLOB to pull them)"
        else:
            chosen.append(f)
            continue
        left_out.append(f)
        reasons[reason] = None
    if not chosen:
        if options.include or options.exclude:
            raise PullError(f"--include/--exclude leave none of the {len(files)} files of {src.url} to pull",
                            ExitCode.USAGE)
        raise PullError(f"{src.url} has no files to pull (only {', '.join(f.path for f in files)})",
                        ExitCode.NOT_FOUND)
    if left_out:
        names = ", ".join(f.path for f in left_out[:6]) + (f" and {len(left_out) - 6} more" if len(left_out) > 6 else "")
        print(f"kvfleet pull: leaving out {len(left_out)} of {len(files)} files "
              f"({sum(f.size for f in left_out) / MiB:.1f} MiB): {names}; {'; '.join(reasons)}",
              file=sys.stderr, flush=True)
    return chosen


# ---------------------------------------------------------------- staging


@dataclass
class ChunkState:
    fingerprint: str
    size: int
    chunk_size: int
    done: dict[str, str] = field(default_factory=dict)   # chunk index -> md5 of its bytes


ETAG_RE = re.compile(r"^[0-9a-f]{32}(-\d+)?$")


def multipart_count(f: RemoteFile) -> int | None:
    """N of a multipart upload's ETag 'md5-N'; None for a plain (or non-MD5) ETag."""
    if f.etag is None or not ETAG_RE.match(f.etag) or "-" not in f.etag:
        return None
    return int(f.etag.split("-")[1])


def guess_part_size(f: RemoteFile, parts: int) -> int:
    """For servers that do not answer HEAD ?partNumber=1: the aws-cli/boto3 default (8 MiB)
    if it gives `parts` parts, else the size split evenly in whole MiB."""
    if -(-f.size // (8 * MiB)) == parts:
        return 8 * MiB
    return -(-f.size // parts // MiB) * MiB or MiB


class PartialFile:
    """The staging copy of one file, and which of its chunks are on disk with their MD5s.

    For a multipart upload the chunks are its parts, so the ETag (the MD5 of the
    parts' MD5s) is checked from digests taken while the bytes arrived, with no
    second read. Chunks left by an earlier, interrupted run are hashed again from
    disk: what a crash left there is not trusted.
    """

    def __init__(self, staging: Path, f: RemoteFile, chunk_size: int) -> None:
        self.file = f
        self.data_path = staging / (f.path + ".part")
        self.state_path = staging / (f.path + ".part.json")
        self.chunk_size = chunk_size
        self.lock = threading.Lock()
        self.fresh: set[int] = set()      # chunks fetched by this run
        self.state = self._load_state()
        self.fd = -1

    def _load_state(self) -> ChunkState:
        fresh = ChunkState(self.file.fingerprint, self.file.size, self.chunk_size)
        try:
            state = ChunkState(**json.loads(self.state_path.read_text()))
        except (OSError, ValueError, TypeError):
            return fresh
        same = (state.fingerprint, state.size, state.chunk_size) == (fresh.fingerprint, fresh.size, fresh.chunk_size)
        if not same or not isinstance(state.done, dict) or not self.data_path.exists() \
                or self.data_path.stat().st_size != self.file.size:
            return fresh
        return state

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.file.size // self.chunk_size))

    def pending(self) -> list[int]:
        return [i for i in range(self.num_chunks) if str(i) not in self.state.done]

    def resumed_bytes(self) -> int:
        return sum(self.bounds(int(i))[1] - self.bounds(int(i))[0] for i in self.state.done)

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.file.size)

    def open(self) -> None:
        self.data_path.parent.mkdir(parents=True, exist_ok=True)
        if not self.state.done:
            self.data_path.unlink(missing_ok=True)
        self.fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT, 0o644)
        if not self.state.done and self.file.size:
            # Reserve the space now: a full disk fails here, before any download.
            os.posix_fallocate(self.fd, 0, self.file.size)
        self._save()

    def write(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def mark_done(self, index: int, md5: str) -> None:
        with self.lock:
            self.state.done[str(index)] = md5
            self.fresh.add(index)
            self._save()

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self.state)))
        os.replace(tmp, self.state_path)

    def _hash_from_disk(self, start: int, end: int, hashes: dict[str, Any]) -> dict[str, str]:
        """Feed bytes start..end of the staged file to each of `hashes` (in one read); name -> hex digest."""
        if not hashes:
            return {}
        with open(self.data_path, "rb") as fh:
            fh.seek(start)
            while start < end:
                block = fh.read(min(PIECE, end - start))
                if not block:
                    break
                start += len(block)
                for h in hashes.values():
                    h.update(block)
        return {name: h.hexdigest() for name, h in hashes.items()}

    def chunk_md5(self, index: int) -> str:
        if index in self.fresh:
            return self.state.done[str(index)]
        return self._hash_from_disk(*self.bounds(index), {"md5": hashlib.md5()})["md5"]

    def problem(self, sha256: str | None) -> str | None:
        """None when the staged file matches the source (its listing and `sha256` from SHA256SUMS);
        otherwise what is wrong with it."""
        f = self.file
        size = os.fstat(self.fd).st_size
        if size != f.size:
            return f"size {size} != {f.size}"
        etag = None
        parts = multipart_count(f)
        if parts is not None:
            if self.num_chunks != parts:
                return f"{self.num_chunks} chunks of {self.chunk_size} bytes cannot match the {parts} parts of ETag {f.etag}"
            digests = b"".join(bytes.fromhex(self.chunk_md5(i)) for i in range(parts))
            etag = f"{hashlib.md5(digests).hexdigest()}-{parts}"
        elif f.etag is not None and ETAG_RE.match(f.etag) and self.num_chunks == 1:
            etag = self.chunk_md5(0)
        # ETags of SSE-KMS objects are not MD5s: only those that are get checked.
        whole_md5 = etag is None and f.etag is not None and ETAG_RE.match(f.etag) is not None
        hashes = {}
        if whole_md5:
            hashes["md5"] = hashlib.md5()
        if sha256 is not None or f.sha256 is not None:
            hashes["sha256"] = hashlib.sha256()
        if f.blob_id is not None:
            hashes["blob"] = hashlib.sha1(b"blob %d\0" % f.size)
        digests_from_disk = self._hash_from_disk(0, f.size, hashes)
        etag = digests_from_disk.get("md5", etag)
        if etag is not None and etag != f.etag:
            return f"ETag {etag} != {f.etag}"
        if f.sha256 is not None and digests_from_disk["sha256"] != f.sha256:
            return f"sha256 {digests_from_disk['sha256']} != {f.sha256} (from the source's listing)"
        if sha256 is not None and digests_from_disk["sha256"] != sha256:
            return f"sha256 {digests_from_disk['sha256']} != {sha256} (from {MANIFEST})"
        if f.blob_id is not None and digests_from_disk["blob"] != f.blob_id:
            return f"git blob id {digests_from_disk['blob']} != {f.blob_id} (from the source's listing)"
        return None

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        self.close()
        self.data_path.unlink(missing_ok=True)
        self.state_path.unlink(missing_ok=True)
        self.state = ChunkState(self.file.fingerprint, self.file.size, self.chunk_size)
        self.fresh.clear()


# ---------------------------------------------------------------- manifest


def parse_manifest(text: str, files: dict[str, RemoteFile]) -> dict[str, str]:
    """`sha256sum` output: '<64 hex> [*]<path>' per line."""
    sums = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = re.match(r"^([0-9a-fA-F]{64}) [ *](.+)$", line)
        if not m:
            raise PullError(f"{MANIFEST} line {lineno} is not '<sha256>  <path>': {line!r}", ExitCode.VERIFY_FAILED)
        digest, path = m.group(1).lower(), m.group(2).removeprefix("./")
        if path not in files:
            raise PullError(f"{MANIFEST} lists {path!r}, which is not in the source", ExitCode.VERIFY_FAILED)
        sums[path] = digest
    return sums


# ---------------------------------------------------------------- transfer


def backoff(attempt: int) -> float:
    """Seconds before retry number attempt + 1: exponential, capped, with jitter (threads spread out)."""
    return min(8.0, 0.25 * 2 ** attempt) * (0.5 + random.random())


class RateLimiter:
    """A shared byte budget per second over all download threads (--max-bandwidth)."""

    def __init__(self, bytes_per_second: int) -> None:
        self.rate = bytes_per_second
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def consume(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
        time.sleep(max(0.0, start - now))


class Transfer:
    """Fetches the pending chunks of many files with a pool of threads."""

    def __init__(self, source: Source, options: PullOptions, total: int) -> None:
        from tqdm import tqdm

        self.source = source
        self.options = options
        self.stop = threading.Event()
        self.limiter = RateLimiter(options.max_bandwidth) if options.max_bandwidth else None
        self.lock = threading.Lock()
        self.fetched = 0
        self.total = total
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="pull",
                        disable=(not options.progress) if options.progress is not None else None,
                        file=sys.stderr)
        # Without a terminal (an init container's log) a bar is unreadable: plain lines instead.
        self.log_lines = options.progress is None and self.bar.disable
        self.started = self.last_log = time.monotonic()

    def fetch_chunk(self, part: PartialFile, index: int) -> None:
        start, end = part.bounds(index)
        if start == end:    # an empty file: nothing to GET (and no valid Range for it)
            part.mark_done(index, hashlib.md5().hexdigest())
            return
        for attempt in range(self.options.retries + 1):
            offset, written, md5 = start, 0, hashlib.md5()
            try:
                for piece in self.source.read_range(part.file, start, end):
                    if self.stop.is_set():
                        return
                    if self.limiter:
                        self.limiter.consume(len(piece))
                    part.write(offset, piece)
                    md5.update(piece)
                    offset += len(piece)
                    written += len(piece)
                    self._count(len(piece))
                if offset != end:
                    raise ConnectionError(f"short read: {offset - start} of {end - start} bytes")
                part.mark_done(index, md5.hexdigest())
                return
            except PullError:
                raise
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise PullError(f"disk full writing {part.data_path}", ExitCode.DISK_FULL) from e
                if not isinstance(e, ConnectionError) and e.errno is not None:
                    raise
                error: Exception = e
            except Exception as e:  # botocore streaming errors: truncated bodies, read timeouts
                error = e
            self._count(-written)
            if attempt == self.options.retries:
                raise PullError(f"reading {part.file.path} failed after {attempt + 1} attempts: {error}",
                                ExitCode.UNREACHABLE) from error
            time.sleep(backoff(attempt))

    def _count(self, n: int) -> None:
        with self.lock:
            self.fetched += n
            self.bar.update(n)
            now = time.monotonic()
            if self.log_lines and now - self.last_log >= self.options.log_interval:
                self.last_log = now
                done = self.bar.n
                rate = self.fetched / MiB / max(now - self.started, 1e-9)
                print(f"kvfleet pull: {done / MiB:.0f} of {self.total / MiB:.0f} MiB "
                      f"({100 * done / max(self.total, 1):.0f}%), {rate:.1f} MiB/s", file=sys.stderr, flush=True)

    def run(self, parts: list[PartialFile]) -> None:
        jobs = [(p, i) for p in parts for i in p.pending()]
        # Biggest chunks of the biggest files first keeps every thread busy to the end.
        jobs.sort(key=lambda job: -job[0].file.size)
        with ThreadPoolExecutor(max_workers=self.options.jobs, thread_name_prefix="pull") as pool:
            futures: list[Future] = [pool.submit(self.fetch_chunk, p, i) for p, i in jobs]
            try:
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                    for fut in done:
                        if fut.exception() is not None:
                            raise fut.exception()
            except BaseException:
                self.stop.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------- the pull


def read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def unchanged_files(dest: Path, marker: dict | None, source_url: str, files: list[RemoteFile]) -> set[str]:
    """Paths an earlier complete pull of the same source already put in DEST, with the same fingerprint."""
    if not marker or marker.get("source") != source_url:
        return set()
    try:
        recorded = {m["path"]: (m["size"], m["fingerprint"]) for m in marker["files"]}
    except (KeyError, TypeError):   # a marker we did not write: trust nothing in DEST
        return set()
    same = set()
    for f in files:
        try:
            if recorded.get(f.path) == (f.size, f.fingerprint) and (dest / f.path).stat().st_size == f.size:
                same.add(f.path)
        except OSError:
            pass
    return same


def safe_relpath(path: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise PullError(f"refusing source path {path!r}: it would land outside DEST", ExitCode.VERIFY_FAILED)
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pull(source: str, dest: Path, options: PullOptions) -> PullResult:
    t0 = time.monotonic()
    src = open_source(source, options)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PullError(f"cannot create DEST {dest}: {e.strerror}", ExitCode.FAILED) from e
    # Two pullers on one shared volume (replicas starting together) take turns.
    with open(dest / LOCK, "a") as lock_fh:
        fcntl.flock(lock_fh, fcntl.LOCK_EX)
        files = select_files(src, src.list_files(), options)
        for f in files:
            safe_relpath(f.path)
        marker = read_marker(dest)
        unchanged = unchanged_files(dest, marker, src.url, files)
        if len(unchanged) == len(files) and len(marker["files"]) == len(files):
            if marker.get("commit") != src.commit:    # a new commit that changed none of our files
                _write_marker(dest, src, files, {m["path"]: m["sha256"] for m in marker["files"] if "sha256" in m})
            total = sum(f.size for f in files)
            return PullResult(src.url, dest, len(files), total, 0, 0, time.monotonic() - t0, up_to_date=True,
                              commit=src.commit)
        return _fetch_all(src, dest, files, unchanged, marker, options, t0)


def _fetch_all(src: Source, dest: Path, files: list[RemoteFile], unchanged: set[str],
               old_marker: dict | None, options: PullOptions, t0: float) -> PullResult:
    # From here until the new marker, DEST is not a complete pull of anything.
    (dest / MARKER).unlink(missing_ok=True)
    staging = dest / STAGING
    todo = [f for f in files if f.path not in unchanged]
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        sizes = list(pool.map(lambda f: chunk_size_for(src, f, options.chunk_size), todo))
    parts = [PartialFile(staging, f, size) for f, size in zip(todo, sizes, strict=True)]
    resumed = sum(p.resumed_bytes() for p in parts)
    total = sum(p.file.size for p in parts)
    needed = total - resumed
    free = shutil.disk_usage(dest).free
    if needed > free:
        raise PullError(f"disk full: {dest} has {free / MiB:.1f} MiB free, the pull needs {needed / MiB:.1f} MiB "
                        "more", ExitCode.DISK_FULL)
    transfer = Transfer(src, options, total=total)
    transfer.bar.update(resumed)
    try:
        by_path = {p.file.path: p for p in parts}
        try:
            for p in parts:
                p.open()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise PullError(f"disk full: cannot reserve space in {dest}", ExitCode.DISK_FULL) from e
            raise
        # The manifest first: the other files are checked against it.
        manifest = by_path.get(MANIFEST)
        sums: dict[str, str] = {}
        if manifest is not None:
            _fetch_verified(transfer, [manifest], {})
            sums = parse_manifest(manifest.data_path.read_text(), {f.path: f for f in files})
        elif MANIFEST in unchanged:
            sums = parse_manifest((dest / MANIFEST).read_text(), {f.path: f for f in files})
        _check_kept(dest, unchanged, sums, old_marker)
        _fetch_verified(transfer, [p for p in parts if p is not manifest], sums)
        _install(dest, parts, files, old_marker)
    finally:
        transfer.close()
        for p in parts:
            if p.fd >= 0:
                os.close(p.fd)
    _write_marker(dest, src, files, sums)
    shutil.rmtree(staging, ignore_errors=True)
    return PullResult(src.url, dest, len(files), sum(f.size for f in files), transfer.fetched, resumed,
                      time.monotonic() - t0, commit=src.commit)


def _fetch_verified(transfer: Transfer, parts: list[PartialFile], sums: dict[str, str]) -> None:
    """Download, verify, and download a file again from scratch once if it does not verify."""
    for attempt in (1, 2):
        transfer.run(parts)
        failed = []
        with ThreadPoolExecutor(max_workers=min(4, len(parts) or 1)) as pool:
            for p, problem in zip(parts, pool.map(lambda p: p.problem(sums.get(p.file.path)), parts), strict=True):
                if problem:
                    failed.append((p, problem))
        if not failed:
            return
        if attempt == 2:
            p, problem = failed[0]
            raise PullError(f"{p.file.path} does not match the source: {problem}; nothing was installed",
                            ExitCode.VERIFY_FAILED)
        for p, problem in failed:
            print(f"kvfleet pull: {p.file.path}: {problem}; fetching it again", file=sys.stderr)
            p.discard()
            p.open()
        parts = [p for p, _ in failed]


def _check_kept(dest: Path, kept: set[str], sums: dict[str, str], old_marker: dict | None) -> None:
    """Files kept from the last pull against a manifest that may be new since."""
    if not kept & sums.keys():
        return
    # kept files exist only when unchanged_files() read the old marker without fault
    recorded = {m["path"]: m.get("sha256") for m in old_marker["files"]}
    for path in sorted(kept & sums.keys()):
        digest = recorded.get(path)
        if digest is None:
            sha = hashlib.sha256()
            with open(dest / path, "rb") as fh:
                while block := fh.read(PIECE):
                    sha.update(block)
            digest = sha.hexdigest()
        if digest != sums[path]:
            raise PullError(f"{path} does not match the source: sha256 {digest} != {sums[path]} (from {MANIFEST})",
                            ExitCode.VERIFY_FAILED)


def chunk_size_for(src: Source, f: RemoteFile, default: int) -> int:
    """A multipart upload is fetched part by part (its ETag needs each part's MD5)."""
    parts = multipart_count(f)
    if parts is None:
        return default
    return src.part_size(f) or guess_part_size(f, parts)


def _install(dest: Path, parts: list[PartialFile], files: list[RemoteFile], old_marker: dict | None) -> None:
    for p in parts:
        p.close()
        target = dest / p.file.path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(p.data_path, target)
        p.state_path.unlink(missing_ok=True)
    # Files of an earlier pull that the source no longer has (e.g. a re-sharded checkpoint).
    current = {f.path for f in files}
    for entry in (old_marker or {}).get("files", []):
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and entry["path"] not in current:
            (dest / safe_relpath(entry["path"])).unlink(missing_ok=True)


def _write_marker(dest: Path, src: Source, files: list[RemoteFile], sums: dict[str, str]) -> None:
    fsync_dir(dest)
    marker = {
        "source": src.url,
        **({"commit": src.commit} if src.commit else {}),
        "completed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": [{**{k: v for k, v in asdict(f).items() if v is not None},
                   **({"sha256": sums[f.path]} if f.path in sums else {})} for f in files],
    }
    tmp = dest / (MARKER + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(marker, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, dest / MARKER)
    fsync_dir(dest)


# ---------------------------------------------------------------- command line


def parse_size(text: str) -> int:
    """'16M', '16MiB', '512k', '1G' or plain bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 16M, 512k or 1G; got {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def _chunk_size(text: str) -> int:
    size = parse_size(text)
    if size < MiB:
        raise argparse.ArgumentTypeError(f"--chunk-size must be at least 1M; got {text!r}")
    return size


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return int(text)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pull", help="copy a model folder from S3, the Hugging Face Hub or a local path into DEST "
                     "(resumable, verified)",
        description="Copy a model folder from s3://bucket/prefix, a Hugging Face Hub model repo "
                    "(hf://ORG/NAME[@REVISION], $HF_ENDPOINT for a mirror, $HF_TOKEN for private and gated repos) "
                    "or a local folder into DEST. Parallel ranged downloads, resumable, verified against sizes, "
                    "ETags, the Hub's sha256 and git blob ids, and a SHA256SUMS manifest when present; DEST gets "
                    f"its files only when complete, and {MARKER} last. A Hub repo with *.safetensors weights "
                    "leaves its other weight formats (*.bin, *.pth, ...) and original/ out unless --include says "
                    "otherwise.",
        epilog="exit codes: 0 ok or up to date, 2 usage, 3 no such bucket/prefix/repository/revision, "
               "4 access denied (or a gated repo), 5 endpoint unreachable, 6 disk full, 7 verification failed, "
               "130 interrupted")
    p.add_argument("source", metavar="SOURCE",
                   help="s3://bucket/prefix, hf://ORG/NAME[@REVISION] (default revision main) or a local folder")
    p.add_argument("dest", metavar="DEST", help="local folder to fill")
    p.add_argument("--endpoint-url", help="S3 endpoint (MinIO, SeaweedFS, ...); default $AWS_ENDPOINT_URL or AWS")
    p.add_argument("--region", help="S3 region; default $AWS_REGION, the AWS config, else us-east-1")
    p.add_argument("--addressing-style", choices=["auto", "path", "virtual"],
                   help="S3 addressing; default path with --endpoint-url, else auto")
    p.add_argument("--no-verify-ssl", dest="verify_ssl", action="store_false", help="do not verify TLS certificates")
    p.add_argument("--ca-bundle", help="PEM bundle of the CA that signed the endpoint's certificate "
                                       "(default $AWS_CA_BUNDLE)")
    p.add_argument("--jobs", "-j", type=_positive_int, default=16, help="parallel connections (default 16)")
    p.add_argument("--chunk-size", type=_chunk_size, default=16 * MiB, help="bytes per ranged GET (default 16M)")
    p.add_argument("--retries", type=int, default=5, help="retries per request, with exponential backoff (default 5)")
    p.add_argument("--max-bandwidth", type=parse_size, help="limit over all connections, bytes/s (e.g. 100M)")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="pull only files matching a GLOB (repeatable; `*` crosses `/`, as in huggingface-cli "
                        "download); replaces the default choice of a Hub repo's files")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="never pull files matching GLOB (repeatable)")
    p.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show a bar")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="never show a bar")
    p.set_defaults(func=run)


def options_from_args(args: argparse.Namespace) -> PullOptions:
    return PullOptions(endpoint_url=args.endpoint_url, region=args.region, addressing_style=args.addressing_style,
                       verify_ssl=args.verify_ssl, ca_bundle=args.ca_bundle, jobs=args.jobs,
                       chunk_size=args.chunk_size, retries=args.retries, max_bandwidth=args.max_bandwidth,
                       progress=args.progress, include=tuple(args.include), exclude=tuple(args.exclude))


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    # Pod deletion sends SIGTERM: stop like Ctrl-C, keeping what is staged for the next attempt.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupted) if in_main else None
    try:
        result = pull(args.source, Path(args.dest), options_from_args(args))
    except PullError as e:
        print(f"kvfleet pull: error: {e}", file=sys.stderr)
        return int(e.code)
    except OSError as e:
        code = ExitCode.DISK_FULL if e.errno == errno.ENOSPC else ExitCode.FAILED
        print(f"kvfleet pull: error: {e}", file=sys.stderr)
        return int(code)
    except KeyboardInterrupt:
        print("kvfleet pull: interrupted; run the same command again to resume", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    source = f"{result.source}@{result.commit}" if result.commit else result.source
    if result.up_to_date:
        print(f"kvfleet pull: {result.dest} is up to date with {source} ({result.files} files)", file=sys.stderr)
    else:
        rate = result.bytes_fetched / MiB / max(result.seconds, 1e-9)
        print(f"kvfleet pull: {result.files} files, {result.bytes_total / MiB:.1f} MiB from {source} to "
              f"{result.dest} in {result.seconds:.1f} s: fetched {result.bytes_fetched / MiB:.1f} MiB "
              f"({rate:.1f} MiB/s), resumed {result.bytes_resumed / MiB:.1f} MiB", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvfleet_runtime.pull SOURCE DEST`: the same command without the other subcommands' imports."""
    parser = argparse.ArgumentParser(prog="kvfleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pull", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
