"""A stand-in for the Hugging Face Hub's HTTP API, for `kvfleet pull hf://` tests.

It is a stand-in because the Hub cannot be reached from CI (no internet). It
speaks only the parts of the Hub's API that huggingface_hub (2.4) uses for a
pull, with the field and header names taken from huggingface_hub's own source
(`hf_api.ModelInfo` / `RepoSibling`, `utils/_http.hf_raise_for_status`,
`file_download.get_hf_file_metadata`, `constants.HUGGINGFACE_HEADER_*`):

- `GET /api/models/{repo_id}/revision/{revision}[?blobs=True]`: `id`, `sha`
  (the commit the revision names), `private`, `gated`, and `siblings`, each
  with `rfilename` and, with blobs=True, `size`, `blobId` (the git blob id)
  and for LFS files `lfs: {sha256, size, pointerSize}`.
- `GET`/`HEAD /{repo_id}/resolve/{revision}/{path}`: a file's bytes with
  `X-Repo-Commit` and `ETag`, Range requests answered 206 with Content-Range.
  LFS files are answered, as on the Hub, by a 302 to an absolute CDN URL
  (`/cdn/{sha256}` on this same server, no Authorization needed: the real
  one is a signed URL) with `X-Linked-Etag` and `X-Linked-Size`.
- `GET /api/agent-harnesses`: the registry huggingface_hub's user-agent code
  fetches once per process (an empty one here; not subject to the knobs below).
- Errors as the Hub sends them: `X-Error-Code: RepoNotFound` (401 without a
  token, 404 with one: private and missing repos look the same),
  `GatedRepo` (401 without a token, 403 with one that was not granted
  access; the listing of a gated repo is public, its files are not),
  `RevisionNotFound` and `EntryNotFound` (404), a 401 with
  `X-Error-Message: Invalid credentials in Authorization header` for an
  unknown token, and a JSON body `{"error": ...}`.

Which files are LFS follows the Hub's default .gitattributes: weight formats
and anything over 10 MiB. Branches move with `push()`; tags stay where
`tag()` put them; any commit sha is a valid revision.

Knobs for tests: `corrupt` (paths served with one byte flipped),
`fail_next(n)` (the next n requests answer 500), `stall(path, offset)`
(ranged reads of that file from `offset` on hang until `release()`),
`after_listing` (a callback run after a listing is answered: moves a branch
mid-pull), and `requests` (what was asked, for asserting what travelled).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# The Hub's default .gitattributes puts these in LFS (a subset that covers model repos).
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ckpt", "*.onnx", "*.gguf",
                "*.model", "*.tflite", "*.ot")
LFS_THRESHOLD = 10 << 20
DEFAULT_GITATTRIBUTES = b"".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n".encode() for p in LFS_PATTERNS)

API_RE = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/revision/(?P<rev>[^/]+)$")
RESOLVE_RE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
CDN_RE = re.compile(r"^/cdn/(?P<sha256>[0-9a-f]{64})$")
RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


def is_lfs(path: str, data: bytes) -> bool:
    return len(data) > LFS_THRESHOLD or any(fnmatchcase(path, p) for p in LFS_PATTERNS)


def folder_files(root: Path) -> dict[str, bytes]:
    """Every file under `root` as repo path -> bytes (what `hf upload` of the folder would commit)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)   # sha -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)                   # branch or tag -> sha
    private: bool = False
    gated: bool = False
    tokens: set[str] = field(default_factory=set)                        # tokens granted read access

    def resolve(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


@dataclass
class Request:
    method: str
    path: str            # unquoted
    range: str | None
    status: int


class HubServer:
    """The stand-in on a free port of 127.0.0.1, serving from threads of this process."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.known_tokens: set[str] = set()
        self.corrupt: set[str] = set()
        self.requests: list[Request] = []
        self.after_listing: Callable[[], None] | None = None
        self._failures = 0
        self._stalls: dict[str, int] = {}
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._commits = 0
        # HF_HOME of the pulls: empty (no token file), and where huggingface_hub may cache what it likes
        self.home = Path(tempfile.mkdtemp(prefix="kvfleet-hf-home-"))
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-stand-in", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def env(self, token: str | None = None) -> dict[str, str]:
        """Environment for a child `kvfleet pull`: this server as HF_ENDPOINT, online, no token but `token`
        (HF_HOME is an empty folder of this server's, so no token file of the machine is read)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HF_", "HUGGING_FACE_")) and k != "TRANSFORMERS_OFFLINE"}
        env.update(HF_ENDPOINT=self.url, HF_HOME=str(self.home))
        if token is not None:
            env["HF_TOKEN"] = token
        return env

    # ---------------------------------------------------------------- repos

    def create_repo(self, repo_id: str, files: dict[str, bytes], *, private: bool = False, gated: bool = False,
                    tokens: tuple[str, ...] = ()) -> str:
        """A repo whose `main` holds `files` (+ the default .gitattributes); returns the commit sha."""
        with self._lock:
            self.repos[repo_id] = Repo(repo_id, private=private, gated=gated, tokens=set(tokens))
            self.known_tokens |= set(tokens)
        return self.push(repo_id, {".gitattributes": DEFAULT_GITATTRIBUTES, **files})

    def push(self, repo_id: str, changes: dict[str, bytes | None], branch: str = "main") -> str:
        """A new commit on `branch` (created from main if new): `changes` adds/replaces files, None deletes."""
        with self._lock:
            repo = self.repos[repo_id]
            base = repo.refs.get(branch) or repo.refs.get("main")
            files = dict(repo.commits[base]) if base else {}
            for path, data in changes.items():
                if data is None:
                    files.pop(path, None)
                else:
                    files[path] = data
            self._commits += 1
            sha = hashlib.sha1(f"{repo_id}:{self._commits}:{sorted(files)}".encode()).hexdigest()
            repo.commits[sha] = files
            repo.refs[branch] = sha
            return sha

    def tag(self, repo_id: str, name: str, sha: str) -> None:
        with self._lock:
            self.repos[repo_id].refs[name] = sha

    def add_token(self, token: str) -> None:
        """A valid token granted nothing in particular (a user who has not accepted a gated repo's terms)."""
        with self._lock:
            self.known_tokens.add(token)

    # ---------------------------------------------------------------- knobs

    def fail_next(self, n: int) -> None:
        """The next `n` requests (of any kind) answer 500."""
        with self._lock:
            self._failures = n

    def stall(self, path: str, offset: int) -> None:
        """Ranged reads of `path` starting at or after `offset` hang until release()."""
        with self._lock:
            self._stalls[path] = offset
            self._released.clear()

    def release(self) -> None:
        with self._lock:
            self._stalls.clear()
        self._released.set()

    def file_requests(self) -> list[Request]:
        """Requests for file bytes (resolve and CDN GETs), not API calls or HEADs."""
        return [r for r in self.requests if r.method == "GET" and not r.path.startswith("/api/")]

    def stop(self) -> None:
        self.release()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)
        shutil.rmtree(self.home, ignore_errors=True)

    # ---------------------------------------------------------------- what the handler asks

    def _take_failure(self) -> bool:
        with self._lock:
            if self._failures > 0:
                self._failures -= 1
                return True
            return False

    def _stall_offset(self, path: str) -> int | None:
        with self._lock:
            return self._stalls.get(path)

    def _blob(self, sha256: str) -> tuple[str, bytes] | None:
        with self._lock:
            for repo in self.repos.values():
                for files in repo.commits.values():
                    for path, data in files.items():
                        if is_lfs(path, data) and hashlib.sha256(data).hexdigest() == sha256:
                            return path, data
        return None


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:   # quiet test output
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        # ------------------------------------------------------------ responses

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  head: bool = False) -> None:
            self._status = status
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str, head: bool) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers, head)

        def _serve(self, head: bool) -> None:
            self._status = 0
            split = urlsplit(self.path)
            path = split.path
            try:
                self._route(path, parse_qs(split.query), head)
            except (BrokenPipeError, ConnectionResetError):   # the client went away (killed mid-transfer)
                self.close_connection = True
            finally:
                with hub._lock:
                    hub.requests.append(Request(self.command, unquote(path), self.headers.get("Range"),
                                                self._status))

        def _token(self) -> str | None:
            auth = self.headers.get("Authorization") or ""
            return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

        def _route(self, path: str, query: dict[str, list[str]], head: bool) -> None:
            if path == "/api/agent-harnesses":
                body = {"standardEnvVars": ["AI_AGENT", "AGENT"], "harnesses": {}}
                self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                return
            if hub._take_failure():
                self._error(500, None, "Internal Error - We're working hard to fix this as soon as possible!", head)
                return
            if m := CDN_RE.match(path):
                found = hub._blob(m["sha256"])
                if found is None:
                    self._error(404, None, "Not Found", head)
                    return
                self._file(found[0], found[1], {"ETag": f'"{m["sha256"]}"'}, head)
                return
            token = self._token()
            if token is not None and token not in hub.known_tokens:
                self._error(401, None, "Invalid credentials in Authorization header", head)
                return
            if m := API_RE.match(path):
                repo = self._repo(unquote(m["repo"]), token, head, listing=True)
                if repo is not None:
                    self._listing(repo, unquote(m["rev"]), "blobs" in query, head)
                return
            if m := RESOLVE_RE.match(path):
                repo = self._repo(unquote(m["repo"]), token, head, listing=False)
                if repo is not None:
                    self._resolve(repo, unquote(m["rev"]), unquote(m["path"]), head)
                return
            self._error(404, None, "Not Found", head)

        def _repo(self, repo_id: str, token: str | None, head: bool, listing: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and token not in repo.tokens):
                self._error(401 if token is None else 404, "RepoNotFound", "Repository not found", head)
                return None
            if repo.gated and not listing and token not in repo.tokens:
                if token is None:
                    message = (f"Access to model {repo_id} is restricted. You must have access to it and be "
                               "authenticated to access it. Please log in.")
                    self._error(401, "GatedRepo", message, head)
                else:
                    message = (f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                               f"Visit {hub.url}/{repo_id} to ask for access.")
                    self._error(403, "GatedRepo", message, head)
                return None
            return repo

        def _listing(self, repo: Repo, revision: str, blobs: bool, head: bool) -> None:
            sha = repo.resolve(revision)
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
                return
            siblings = []
            for path, data in sorted(repo.commits[sha].items()):
                sibling: dict[str, object] = {"rfilename": path}
                if blobs:
                    if is_lfs(path, data):
                        pointer = lfs_pointer(data)
                        sibling.update(size=len(data), blobId=git_blob_id(pointer), lfs={
                            "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": len(pointer)})
                    else:
                        sibling.update(size=len(data), blobId=git_blob_id(data))
                siblings.append(sibling)
            body = {"_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id,
                    "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0] if "/" in repo.repo_id else None,
                    "sha": sha, "lastModified": "2026-01-01T00:00:00.000Z", "private": repo.private,
                    "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                    "tags": [], "library_name": "transformers", "siblings": siblings,
                    "createdAt": "2025-01-01T00:00:00.000Z"}
            # before answering: whatever the client asks next finds the branch already moved
            if hub.after_listing is not None:
                callback, hub.after_listing = hub.after_listing, None
                callback()
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)

        def _resolve(self, repo: Repo, revision: str, path: str, head: bool) -> None:
            sha = repo.resolve(revision)
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
                return
            data = repo.commits[sha].get(path)
            if data is None:
                self._error(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"", head)
                return
            headers = {"X-Repo-Commit": sha}
            if is_lfs(path, data):
                digest = hashlib.sha256(data).hexdigest()
                headers.update({"ETag": f'"{git_blob_id(lfs_pointer(data))}"', "X-Linked-Etag": f'"{digest}"',
                                "X-Linked-Size": str(len(data)), "Location": f"{hub.url}/cdn/{digest}"})
                self._send(302, b"", headers, head)
                return
            headers["ETag"] = f'"{git_blob_id(data)}"'
            self._file(path, data, headers, head)

        def _file(self, path: str, data: bytes, headers: dict[str, str], head: bool) -> None:
            if path in hub.corrupt and data:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            wanted = self.headers.get("Range")
            if wanted is None:
                self._send(200, data, headers, head)
                return
            m = RANGE_RE.match(wanted)
            start = int(m[1]) if m else len(data)
            end = min(int(m[2]) + 1 if m and m[2] else len(data), len(data))
            if start >= len(data) or end <= start:
                self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head)
                return
            stall_at = hub._stall_offset(path)
            if stall_at is not None and start >= stall_at and not head:
                hub._released.wait(timeout=300)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            self._send(206, data[start:end], headers, head)

    return Handler
