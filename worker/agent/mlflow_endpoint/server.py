"""The HTTP side of the endpoint: a small server on the loopback interface, its connections
bounded (see the package's docstring), each request's body read and checked, answered in
MLflow's JSON or with MLflow's error."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from worker.agent.mlflow_endpoint import ranks
from worker.agent.mlflow_endpoint.calls import dispatch
from worker.agent.mlflow_endpoint.errors import MlflowError
from worker.agent.mlflow_endpoint.records import TrackedProcess
from worker.agent.mlflow_endpoint.store import TrackingStore

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
# Connections served at once by one endpoint (a thread each). A job's processes on a node
# (at most a few dozen, each with a keep-alive connection or a few) fit; more wait.
MAX_CONNECTIONS = 32
# A connection silent this long (no request, or a request stalled halfway) is closed.
CONNECTION_TIMEOUT_S = 30.0
LISTEN_BACKLOG = 128
# How long stop() lets calls in progress finish before it cuts their connections.
STOP_WAIT_S = 5.0
API_PREFIXES = ("/api/2.0/mlflow/", "/ajax-api/2.0/mlflow/", "/api/2.0/preview/mlflow/")


NO_UI_PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>torchyard: MLflow tracking endpoint</title></head>
<body><h1>MLflow tracking endpoint of a torchyard job</h1>
<p>This address is the MLflow tracking endpoint that the worker node runs for one script job.
It serves MLflow's REST calls from the job's processes and has no web UI.</p>
<p>The job's metrics, params, tags, runs and logged models are on the job's page in
torchyard's web UI, in <code>torchyard metrics JOB</code> and in <code>GET /v1/jobs/JOB</code>
(<code>tracking</code>) on the API; the files MLflow logged are in the job's outputs under
<code>mlflow/</code>.</p>
</body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def setup(self) -> None:
        super().setup()
        # Each read and write of the connection waits at most this long.
        self.connection.settimeout(self.server.connection_timeout_s)
        # Small answers at once: no waiting for the client's delayed acknowledgement.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_one_request(self) -> None:
        if not self.server.await_request(self):
            self.close_connection = True
            return
        super().handle_one_request()

    def _answer(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = [
            f"{self.protocol_version} {status} {HTTPStatus(status).phrase}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(data)}",
        ]
        if self.close_connection:
            head.append("Connection: close")
        # Headers and body in one write.
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)

    def _serve(self, method: str) -> None:
        try:
            body = self._read(method)
            if method == "GET" and urlsplit(self.path).path == "/":
                # The page of MLflow's "View run" link (its #/experiments/... part stays in the browser).
                self._answer(200, NO_UI_PAGE, "text/html; charset=utf-8")
                return
            proc = self._caller()
            path = urlsplit(self.path).path
            prefix = next((p for p in API_PREFIXES if path.startswith(p)), None)
            if prefix is None:
                raise MlflowError(f"{method} {path} is not served here", "ENDPOINT_NOT_FOUND", 404)
            answer = dispatch(self.server.store, proc, method, path[len(prefix) :].strip("/"), body)
            self._answer(200, answer)
        except (TimeoutError, ConnectionError):
            self.close_connection = True  # too slow, or gone: no answer
        except MlflowError as exc:
            self._answer(exc.status, {"error_code": exc.code, "message": exc.message})
        except Exception:
            log.exception("MLflow endpoint: %s %s failed", method, self.path)
            self._answer(500, {"error_code": "INTERNAL_ERROR", "message": "the call failed on the node"})

    def _caller(self) -> TrackedProcess:
        """The process of the placement that calls (its token), as the rank it is."""
        auth = self.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        proc = self.server.store.process(token)
        if proc is None:
            raise MlflowError("a token of this job is needed (MLFLOW_TRACKING_TOKEN)", "UNAUTHENTICATED", 401)
        if proc.ranks_from_caller:
            rank = self._caller_rank()
            with self.server.store.lock:
                proc = proc.as_rank(rank)
        return proc

    def _caller_rank(self) -> int | None:
        """The ``RANK`` of the process at the other end of this connection (looked up once)."""
        if not hasattr(self, "_rank"):
            bridged = self.server.store.bridged_rank(self.client_address)
            if bridged is not None:  # relayed from a run without network: its relay said
                self._rank = bridged[0]
            else:
                self._rank = ranks.caller_rank(self.client_address, self.server.server_address)
        return self._rank

    def _read(self, method: str) -> dict[str, Any]:
        if method == "GET":
            query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
            return {k: v[-1] for k, v in query.items()}
        declared = self.headers.get("Content-Length", "0")
        if not declared.isdigit():
            self.close_connection = True
            raise MlflowError("a request needs a Content-Length")
        size = int(declared)
        if size > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read: the connection cannot go on
            raise MlflowError(f"a request body holds at most {MAX_BODY_BYTES} bytes, not {size}", status=413)
        raw = self.rfile.read(size) if size else b"{}"
        if len(raw) < size:
            raise ConnectionAbortedError("the connection ended within the request's body")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise MlflowError(f"the request body is not JSON: {exc}", "MALFORMED_REQUEST") from None
        if not isinstance(body, dict):
            raise MlflowError("the request body must be a JSON object", "MALFORMED_REQUEST")
        return body


class _Server(ThreadingHTTPServer):
    """At most ``max_connections`` connections served at once, each silent at most
    ``connection_timeout_s``; under pressure the one idle the longest is closed."""

    daemon_threads = True
    block_on_close = False  # server_close() waits for the calls in progress itself, boundedly
    request_queue_size = LISTEN_BACKLOG
    store: TrackingStore

    def __init__(self, address: tuple[str, int], max_connections: int, connection_timeout_s: float) -> None:
        super().__init__(address, _Handler)
        self.connection_timeout_s = connection_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._guard = threading.Lock()
        # Each connection served: since when it waits for a request (None: in one).
        self._open: dict[socket.socket, float | None] = {}
        self._closing = False

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the serving thread: wait for a free slot (further connections wait in the
        listen backlog), closing the connection idle the longest to free one."""
        acquired = self._slots.acquire(blocking=False)
        while not acquired:
            if self._closing:
                self.shutdown_request(request)
                return
            self._close_idle(every=False)
            acquired = self._slots.acquire(timeout=0.1)
        with self._guard:
            self._open[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: Any) -> None:
        with self._guard:
            self._open.pop(request, None)
        self._slots.release()

    def await_request(self, handler: _Handler) -> bool:
        """Wait, counted idle, for the connection's next request (its first, or the next on
        a kept-alive connection): False when it ends, stays silent, or is closed for room."""
        connection = handler.connection
        with self._guard:
            if self._closing or connection not in self._open:
                return False
            self._open[connection] = time.monotonic()
        try:
            ready = cast(io.BufferedReader, handler.rfile).peek(1) != b""
        except OSError:  # silent past the timeout, or reset
            ready = False
        with self._guard:
            if connection not in self._open:
                return False  # closed to make room
            self._open[connection] = None
        return ready

    def _close_idle(self, every: bool) -> None:
        """Close the connection idle the longest (``every``: all idle ones); its thread ends."""
        with self._guard:
            idle = sorted(
                (since, n, c) for n, (c, since) in enumerate(self._open.items()) if since is not None
            )
            for _since, _n, connection in idle if every else idle[:1]:
                del self._open[connection]
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def shutdown(self) -> None:
        self._closing = True
        self._close_idle(every=True)
        super().shutdown()

    def server_close(self) -> None:
        """Close the listening socket, let the calls in progress finish (STOP_WAIT_S at
        most), then cut what is left."""
        super().server_close()
        deadline = time.monotonic() + STOP_WAIT_S
        while self._open and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._guard:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("MLflow endpoint: a connection from %s failed", client_address, exc_info=True)


class TrackingEndpoint:
    """The endpoint of one placement: ``start()``, ``env_for(rank, name)`` per process, ``stop()``."""

    def __init__(
        self,
        state_dir: Path,
        outputs_dir: Path,
        node_rank: int,
        host: str = "127.0.0.1",
        *,
        max_connections: int = MAX_CONNECTIONS,
        connection_timeout_s: float = CONNECTION_TIMEOUT_S,
    ) -> None:
        self.store = TrackingStore(state_dir, outputs_dir, node_rank)
        self.host = host
        self.max_connections = max_connections
        self.connection_timeout_s = connection_timeout_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where the endpoint listens (host, port)."""
        assert self._server is not None, "the endpoint is not started"
        return self.host, int(self._server.server_address[1])

    @property
    def uri(self) -> str:
        assert self._server is not None, "the endpoint is not started"
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> None:
        (self.store.state_dir / "metrics").mkdir(parents=True, exist_ok=True)
        server = _Server((self.host, 0), self.max_connections, self.connection_timeout_s)
        server.store = self.store
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="mlflow-endpoint", daemon=True)
        self._thread.start()

    def env_for(self, rank: int, name: str, *, ranks_from_caller: bool = False) -> dict[str, str]:
        """The variables that point one process's MLflow client here (``ranks_from_caller``:
        a node's command whose ranks, started by it, share them)."""
        token = self.store.add_process(rank, name, ranks_from_caller=ranks_from_caller)
        return {
            "MLFLOW_TRACKING_URI": self.uri,
            "MLFLOW_TRACKING_TOKEN": token,
            # The client's "View run ... at" links would name this node's loopback, no UI.
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        }

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
