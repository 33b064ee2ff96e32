"""`torchyard db upgrade`, `torchyard token create` and `torchyard serve`, as real processes."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.serving import _bind
from tests.conftest import free_port
from tests.support.factories import auth

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchyard.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_db_upgrade_token_create_and_serve(tmp_path: Path, db_url: str) -> None:
    env = {**os.environ, "TORCHYARD_DATA_DIR": str(tmp_path / "data"), "TORCHYARD_DATABASE_URL": db_url}
    up = _run(["db", "upgrade"], env)
    assert up.returncode == 0, up.stderr
    made = _run(["token", "create", "--role", "user", "--name", "dora"], env)
    assert made.returncode == 0, made.stderr
    user_token = made.stdout.strip()
    assert user_token.startswith("ty_")
    bad = _run(["token", "create", "--role", "root", "--name", "x"], env)
    assert bad.returncode != 0
    assert "invalid choice" in bad.stderr

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchyard.cli", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.2)
        me = httpx.get(f"{base}/v1/whoami", headers=auth(user_token)).json()
        assert me["name"] == "dora"
        assert me["role"] == "user"
        admin = (tmp_path / "data" / "admin.token").read_text().strip()
        assert httpx.get(f"{base}/v1/whoami", headers=auth(admin)).json()["role"] == "admin"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_refuses_bad_settings(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHYARD_DATA_DIR": str(tmp_path), "TORCHYARD_LEASE_TIMEOUT_S": "0.1"}
    r = _run(["serve", "--port", str(free_port())], env, timeout=60)
    assert r.returncode == 2
    # One clear line naming the variable and the value, no traceback.
    assert r.stderr.startswith("error: InvalidSettingsError: settings: TORCHYARD_LEASE_TIMEOUT_S (0.1) ")
    env["TORCHYARD_LEASE_TIMEOUT_S"] = "-1"
    r = _run(["serve", "--port", str(free_port())], env, timeout=60)
    assert r.returncode == 2
    assert (
        "error: InvalidSettingsError: TORCHYARD_LEASE_TIMEOUT_S: Input should be greater than 0 (got '-1')"
        in r.stderr
    )
    assert "Traceback" not in r.stderr


def test_serve_socket_lets_asyncio_disable_nagle() -> None:
    """Connections accepted on `serve`'s socket have TCP_NODELAY set.

    Without it a keep-alive client waits for its own delayed ACK between the response's
    header and body writes: about 40 ms a request."""
    listener = _bind("127.0.0.1", free_port())
    nodelay: list[int] = []

    async def main() -> None:
        def accepted(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listener)
        async with server:
            _reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            while not nodelay:
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert nodelay == [1]
