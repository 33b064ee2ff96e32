"""The host side of a run without network (``environment.network: none``): a Unix socket of
the agent's, bound into the run's sandbox, whose connections go on to the placement's MLflow
endpoint on the node's loopback.

Inside the sandbox, :mod:`worker.agent.net_relay` listens on the endpoint's port of the
run's own loopback and relays each connection here, after one line naming the caller's rank
(``rank <RANK>`` or ``rank -``). The bridge opens a connection to the endpoint for it, tells
the endpoint which rank that connection speaks for, and copies bytes both ways. At most
``max_connections`` are relayed at once (further ones wait in the listen backlog), each
closed after ``idle_s`` without a byte either way.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

from worker.agent.mlflow_endpoint.server import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS, TrackingEndpoint
from worker.agent.net_relay import pump

# Where the socket is shown inside the sandbox (its private /tmp).
SOCKET_IN_SANDBOX = "/tmp/.torchyard-mlflow.sock"
_PREAMBLE_BYTES = 32


def _rank_line(conn: socket.socket) -> int | None:
    """The relay's first line: the caller's rank, or None (``rank -``, or anything else)."""
    data = b""
    while not data.endswith(b"\n") and len(data) < _PREAMBLE_BYTES:
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    words = data.decode("ascii", errors="replace").split()
    if len(words) == 2 and words[0] == "rank" and words[1].isascii() and words[1].isdigit():
        return int(words[1])
    return None


class Bridge:
    """A Unix socket at ``path`` relayed to ``endpoint``; ``owner`` (uid, gid) may connect."""

    def __init__(
        self,
        path: Path,
        endpoint: TrackingEndpoint,
        owner: tuple[int, int] | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_s: float = CONNECTION_TIMEOUT_S,
    ) -> None:
        self.path = path
        self.endpoint = endpoint
        self.owner = owner
        self.idle_s = idle_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Through a descriptor of its folder: a socket's path holds 107 bytes at most, and a
        # work directory's may be longer.
        folder = os.open(self.path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            listener.bind(f"/proc/self/fd/{folder}/{self.path.name}")
        finally:
            os.close(folder)
        os.chmod(self.path, 0o600)
        if self.owner is not None:
            os.chown(self.path, *self.owner)
        listener.listen(128)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name="mlflow-bridge", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            self._slots.acquire()
            try:
                conn, _ = self._listener.accept()
            except OSError:
                self._slots.release()
                return
            threading.Thread(target=self._serve, args=(conn,), name="mlflow-bridge-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        address: tuple[str, int] | None = None
        store = self.endpoint.store
        try:
            with conn, contextlib.suppress(OSError):
                conn.settimeout(self.idle_s)
                rank = _rank_line(conn)
                host, port = self.endpoint.address
                with socket.create_connection((host, port), timeout=self.idle_s) as upstream:
                    address = upstream.getsockname()[:2]
                    store.bridge(address, rank)
                    pump(conn, upstream, idle_s=self.idle_s)
        finally:
            if address is not None:
                store.unbridge(address)
            self._slots.release()

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        if self._thread is not None:
            self._thread.join(5)
        self.path.unlink(missing_ok=True)
