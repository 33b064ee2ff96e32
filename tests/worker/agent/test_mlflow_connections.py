"""The MLflow endpoint of a placement holds a bounded number of connections at once and
closes those that stay idle or send too slowly: a script opening connections by the hundred
costs the node's agent a bounded number of threads, and the job's calls still get through."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from worker.agent.mlflow_endpoint.server import MAX_CONNECTIONS, TrackingEndpoint

MARGIN = 3


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[TrackingEndpoint]:
    (tmp_path / "outputs").mkdir()
    ep = TrackingEndpoint(tmp_path / "state", tmp_path / "outputs", node_rank=0, connection_timeout_s=1.0)
    ep.start()
    try:
        yield ep
    finally:
        ep.stop()


def _idle_connections(
    endpoint: TrackingEndpoint, count: int, threads: list[int] | None = None
) -> list[socket.socket]:
    """Connections that send nothing, one after another (each accepted before the next, so
    that an endpoint without bounds would hold them all); ``threads`` gets the process's
    thread count after each."""
    host, port = endpoint.uri.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.setblocking(False)
        sockets.append(sock)
        if threads is not None:
            threads.append(threading.active_count())
    return sockets


def _closed_by_the_endpoint(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset, or never connected (a handshake given up)


def _get(endpoint: TrackingEndpoint, token: str, timeout: float = 10.0) -> httpx.Response:
    return httpx.get(
        f"{endpoint.uri}/api/2.0/mlflow/experiments/get",
        params={"experiment_id": "0"},
        headers={"Authorization": f"Bearer {token}"},
        timeout=timeout,
    )


def test_idle_connections_take_a_bounded_number_of_threads_and_are_closed(
    endpoint: TrackingEndpoint,
) -> None:
    token = endpoint.env_for(0, "rank-0")["MLFLOW_TRACKING_TOKEN"]
    before = threading.active_count()
    counts: list[int] = []
    sockets = _idle_connections(endpoint, 200, counts)
    try:
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            counts.append(threading.active_count())
            time.sleep(0.01)
        most = max(counts) - before
        assert most <= MAX_CONNECTIONS + MARGIN, f"{most} threads for 200 idle connections"
        # Past the idle timeout every connection is closed, and its thread gone.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_closed_by_the_endpoint(s) for s in sockets):
            time.sleep(0.1)
        assert all(_closed_by_the_endpoint(s) for s in sockets)
        while time.monotonic() < deadline and threading.active_count() > before:
            time.sleep(0.05)
        assert threading.active_count() <= before
    finally:
        for sock in sockets:
            sock.close()
    assert _get(endpoint, token).status_code == 200


def test_a_call_gets_through_while_idle_connections_fill_the_endpoint(tmp_path: Path) -> None:
    """The connection idle the longest makes room for a new one: the job's own calls are
    not kept waiting for idle ones to time out."""
    (tmp_path / "outputs").mkdir()
    ep = TrackingEndpoint(tmp_path / "state", tmp_path / "outputs", node_rank=0, connection_timeout_s=60)
    ep.start()
    sockets: list[socket.socket] = []
    try:
        token = ep.env_for(0, "rank-0")["MLFLOW_TRACKING_TOKEN"]
        sockets = _idle_connections(ep, MAX_CONNECTIONS * 3)
        time.sleep(0.3)
        started = time.monotonic()
        assert _get(ep, token, timeout=5).status_code == 200
        assert time.monotonic() - started < 5
        # Keep-alive: one connection, several calls.
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=5) as client:
            for _ in range(3):
                answer = client.get(f"{ep.uri}/api/2.0/mlflow/experiments/get", params={"experiment_id": "0"})
                assert answer.status_code == 200
                assert answer.headers.get("connection") != "close"
    finally:
        for sock in sockets:
            sock.close()
        started = time.monotonic()
        ep.stop()
        assert time.monotonic() - started < 5


def test_a_request_sent_too_slowly_is_dropped(endpoint: TrackingEndpoint) -> None:
    token = endpoint.env_for(0, "rank-0")["MLFLOW_TRACKING_TOKEN"]
    host, port = endpoint.uri.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /api/2.0/mlflow/runs/create HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + token.encode() + b'\r\nContent-Length: 100\r\n\r\n{"exp'
        )
        started = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(4096) == b""  # closed, nothing answered
        assert time.monotonic() - started < 8
    assert _get(endpoint, token).status_code == 200
