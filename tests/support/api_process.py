"""``torchyard serve`` as a real subprocess on a fixed loopback port, to SIGKILL, SIGTERM and
start again (the same port, data directory and database), as an operator's restart would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import free_port


class ApiProcess:
    def __init__(
        self,
        data_dir: Path,
        database_url: str | None,
        *,
        port: int | None = None,
        settings: dict[str, str] | None = None,
        name: str = "api",
        host: str = "127.0.0.1",
    ) -> None:
        self.data_dir = data_dir
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = data_dir.parent / f"{name}-{self.port}.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        self.env = {**base, "TORCHYARD_DATA_DIR": str(data_dir), **(settings or {})}
        if database_url is not None:
            self.env["TORCHYARD_DATABASE_URL"] = database_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> ApiProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torchyard.cli",
                    "serve",
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                ],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 120) -> ApiProcess:
        """Until ``/readyz`` answers 200 (serving, database reachable)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=3).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.alive(), (
                f"serve exited with {self.proc and self.proc.returncode}:\n{self.log()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"serve did not become ready:\n{self.log()[-4000:]}"
            time.sleep(0.1)

    @property
    def admin_token(self) -> str:
        return (self.data_dir / "admin.token").read_text().strip()

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def terminate(self, timeout: float = 30) -> None:
        """SIGTERM: uvicorn finishes the requests in flight and stops."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class SseFollower:
    """Follows ``GET /v1/jobs/{id}/events`` in a thread as a browser's EventSource would:
    reconnects after any cut, 503 or refused connection, with ``Last-Event-ID``, possibly to
    another replica, until the job's final status (or ``end``) arrives."""

    def __init__(self, urls: list[str], token: str, job_id: str) -> None:
        self.urls = urls
        self.headers = {"Authorization": f"Bearer {token}"}
        self.job_id = job_id
        self.events: list[tuple[str, str, dict[str, object]]] = []  # (id, kind, data)
        self.last_id: str | None = None
        self.reconnects = 0
        self.statuses: list[int] = []
        self.done = False
        import threading

        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SseFollower:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        turn = 0
        while not self.done and not self._stop.is_set():
            url = self.urls[turn % len(self.urls)]
            turn += 1
            headers = dict(self.headers)
            if self.last_id is not None:
                headers["Last-Event-ID"] = self.last_id
            try:
                with httpx.stream(
                    "GET", f"{url}/v1/jobs/{self.job_id}/events", headers=headers, timeout=30
                ) as response:
                    self.statuses.append(response.status_code)
                    if response.status_code == 200:
                        self._read(response)
                    else:
                        response.read()
            except (httpx.HTTPError, ValueError):
                pass
            if not self.done:
                self.reconnects += 1
                time.sleep(0.3)

    def _read(self, response: httpx.Response) -> None:
        import json

        event_id, kind, data = None, None, ""
        for line in response.iter_lines():
            if self._stop.is_set():
                return
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
            elif line == "" and kind is not None:
                payload = json.loads(data)
                if event_id is not None:
                    self.events.append((event_id, kind, payload))
                    self.last_id = event_id
                if kind == "end" or (kind == "status" and payload.get("final")):
                    self.done = True
                    return
                event_id, kind, data = None, None, ""

    def of_kind(self, kind: str) -> list[dict[str, object]]:
        return [data for _id, k, data in self.events if k == kind]
