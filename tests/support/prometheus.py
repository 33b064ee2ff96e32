"""A real Prometheus server for the tests: Debian's ``prometheus`` binary (``.ci/prometheus.sh``
unpacks it into CI's cache), on a free loopback port with its own storage folder, scraping
the targets it is given every second."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN_ENV = "TORCHYARD_PROMETHEUS_BIN"
REQUIRE_ENV = "TORCHYARD_REQUIRE_PROMETHEUS"


def prometheus_binary() -> str | None:
    """``TORCHYARD_PROMETHEUS_BIN``, else the one ``.ci/prometheus.sh`` unpacked, else PATH's."""
    named = os.environ.get(BIN_ENV)
    if named:
        return named if os.access(named, os.X_OK) else None
    try:
        cached = subprocess.run(
            [str(ROOT / ".ci" / "prometheus.sh"), "--cached-only"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        cached = None
    if cached is not None and cached.returncode == 0 and cached.stdout.strip():
        return cached.stdout.strip().splitlines()[-1]
    return shutil.which("prometheus")


def require_prometheus() -> str:
    """The binary's path; skip without one, or fail when ``TORCHYARD_REQUIRE_PROMETHEUS=1`` (CI)."""
    binary = prometheus_binary()
    if binary is not None:
        return binary
    reason = f"no prometheus binary ({BIN_ENV} unset or not executable; run .ci/prometheus.sh to fetch one)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires the Prometheus tests to run")
    pytest.skip(f"{reason}; {REQUIRE_ENV}=1 makes this fail")


class Prometheus:
    """``prometheus`` scraping ``targets`` (``{"job": ..., "target": "host:port", ...}``)."""

    def __init__(self, binary: str, folder: Path, port: int, scrape_configs: list[dict[str, Any]]) -> None:
        self.binary = binary
        self.folder = folder
        self.port = port
        self.config = folder / "prometheus.yml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": scrape_configs,
                }
            )
        )
        self.log = folder / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    def start(self) -> Prometheus:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    f"--storage.tsdb.path={self.folder / 'data'}",
                    "--storage.tsdb.retention.time=1h",
                    "--web.enable-lifecycle",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.folder,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                if self.http.get("/-/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus did not get ready: {self.log.read_text()[-2000:]}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector ``promql`` evaluates to now."""
        r = self.http.get("/api/v1/query", params={"query": promql})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, promql: str, timeout: float = 15.0) -> list[dict[str, Any]]:
        """The first non-empty answer to ``promql`` (fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result or time.monotonic() > deadline:
                assert result, f"no series for {promql} after {timeout:g} s; targets: {self.targets()}"
                return result
            time.sleep(0.2)

    def targets(self) -> list[dict[str, Any]]:
        r = self.http.get("/api/v1/targets")
        active: list[dict[str, Any]] = r.json()["data"]["activeTargets"]
        return active

    def stop(self) -> None:
        self.http.close()
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
