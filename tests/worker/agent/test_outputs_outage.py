"""A script job's outputs upload waits out an API outage as the other reports do.

A real HTTP server on loopback answers the PUT with 503 (an API behind its proxy while it
restarts) several times, then stores the archive. Without a deadline the upload gives up after
its few tries; with the placement's outage deadline it waits and the archive arrives whole.
The backoff's sleeps are skipped so the test takes no time: the retry count is what is checked.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from torchyard.contract.errors import TorchyardError
from torchyard.contract.headers import SHA256_HEADER
from worker.agent import model_transfer
from worker.agent.script_outputs import upload_outputs


class _Outage:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.requests = 0
        self.stored: bytes | None = None
        self.sha256: str | None = None


@pytest.fixture
def api() -> Iterator[tuple[str, _Outage]]:
    outage = _Outage(failures=7)

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            outage.requests += 1
            if outage.requests <= outage.failures:
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"error": {"code": "ServiceUnavailable", "message": "restarting"}}')
                return
            outage.stored, outage.sha256 = body, self.headers[SHA256_HEADER]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", outage
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def no_backoff_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_transfer.time, "sleep", lambda _s: None)


def _outputs(tmp_path: Path) -> Path:
    folder = tmp_path / "outputs"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"weights" * 100)
    return folder


def test_without_a_deadline_the_upload_gives_up_after_its_tries(
    api: tuple[str, _Outage], tmp_path: Path
) -> None:
    url, outage = api
    with httpx.Client(base_url=url) as client:
        ctx: Any = SimpleNamespace(api=SimpleNamespace(client=client))
        with pytest.raises(TorchyardError, match="upload failed after"):
            upload_outputs(ctx, "job-1", "lease", _outputs(tmp_path))
    assert outage.requests == model_transfer._UPLOAD_TRIES
    assert outage.stored is None


def test_with_the_outage_deadline_the_outputs_arrive_after_the_api_returns(
    api: tuple[str, _Outage], tmp_path: Path
) -> None:
    import time

    url, outage = api
    with httpx.Client(base_url=url) as client:
        ctx: Any = SimpleNamespace(api=SimpleNamespace(client=client))
        sha256 = upload_outputs(
            ctx, "job-1", "lease", _outputs(tmp_path), outage_deadline=time.monotonic() + 3600
        )
    assert outage.requests == outage.failures + 1
    assert outage.stored is not None and hashlib.sha256(outage.stored).hexdigest() == sha256
    assert outage.sha256 == sha256
    assert not (tmp_path / "outputs.tar.gz").exists()  # the packed archive is removed
