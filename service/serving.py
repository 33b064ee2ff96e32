"""``torchyard serve``: the API on uvicorn, optionally with one local worker agent beside it.

``--with-worker`` is the embedded default for a single machine: the API and a worker
agent (a child process) run on one machine. The worker's token is created once and kept
in ``<data dir>/worker.token`` (mode 0600); the worker works in ``<data dir>/worker``, and
its runs' sandboxes never show the data directory. On SIGINT/SIGTERM the worker is stopped
first, while the API still answers its last reports, then the API shuts down.

The log keeps to what matters: at the default level the access lines of routine polling
(worker heartbeats and claims, health checks) are left out unless they fail, and so is
Alembic's start-up chatter; ``--log-level debug`` shows everything.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from service.config import Settings
from service.storage import is_storage_credential
from torchyard.contract.jobspec import SANDBOX_HIDE_VARIABLE

log = logging.getLogger(__name__)

WORKER_TOKEN_FILE = "worker.token"
WORKER_STOP_GRACE_S = 30.0
LOCAL_WORKER_NODE_WAIT_S = 300.0
GRACEFUL_SHUTDOWN_S = 5
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
# Requests every worker (or health check) makes every few seconds: one access line each
# would be most of the log.
_ROUTINE_PATHS = re.compile(r"^(/v1/worker/nodes/[^/?]+/(heartbeat|claim)|/healthz|/readyz)(\?|$)")


class _RoutineAccessFilter(logging.Filter):
    """Leaves out uvicorn access lines of routine polling that succeeded."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn.access: (client address, method, path with query, HTTP version, status)
        if isinstance(args, tuple) and len(args) == 5:
            path, status = args[2], args[4]
            if isinstance(path, str) and isinstance(status, int) and status < 400:
                return _ROUTINE_PATHS.match(path) is None
        return True


class _MigrationsAppliedFilter(logging.Filter):
    """Keeps Alembic's lines about migrations actually run, not the set-up details."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.getMessage().startswith("Running ")


def configure_logging(level: str) -> None:
    """The log level of ``serve``; below debug, routine lines are left out (see above)."""
    debug = level == "debug"
    logging.getLogger().setLevel(level.upper())
    # Alembic logs each of its plugins as it is imported, and its dialect set-up at every
    # start; at debug level all of it is kept.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.DEBUG if debug else logging.WARNING)
    for name, quiet in (
        ("alembic.runtime.migration", _MigrationsAppliedFilter),
        ("uvicorn.access", _RoutineAccessFilter),
    ):
        logger = logging.getLogger(name)
        for existing in [f for f in logger.filters if isinstance(f, quiet)]:
            logger.removeFilter(existing)
        if not debug:
            logger.addFilter(quiet())


def worker_token_path(settings: Settings) -> Path:
    return settings.data_dir / WORKER_TOKEN_FILE


def ensure_worker_token(settings: Settings) -> str:
    """Prepare the database (migrations, admin token) and return the local worker's token,
    creating it at the first start."""
    from service.api.app import bootstrap
    from service.services.tokens import ensure_bootstrap_token
    from service.states import Role

    db = bootstrap(settings)
    try:
        with db.transaction() as session:
            ensure_bootstrap_token(session, worker_token_path(settings), Role.WORKER, "local-worker")
    finally:
        db.dispose()
    return worker_token_path(settings).read_text().strip()


def default_worker_slots() -> int:
    """CPU slots of the local worker on a machine without GPUs: one per core, up to 8
    (on a GPU machine the agent counts GPUs instead)."""
    return max(1, min(8, os.cpu_count() or 1))


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything starts (the port is taken and the local
    worker knows its URL), but not listening yet: uvicorn listens once start-up is done.
    A client that connects while the API still waits for its database is refused at once
    and tries again, instead of hanging on a connection nobody answers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose ``proto`` says
    # TCP. With proto 0, every keep-alive response whose headers and body go out in two
    # writes would wait for the client's delayed ACK (about 40 ms a request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def _local_api_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def refuse_inspection() -> None:
    """Make ``serve`` non-dumpable: another process of the same user can no longer read its
    memory or ``/proc/<pid>/environ`` (the database URL, tokens in memory) nor attach a
    debugger, and it writes no core dump. Children it ``exec``s are not affected."""
    with contextlib.suppress(OSError, AttributeError):
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_DUMPABLE, 0) failed: errno %d", ctypes.get_errno())


def worker_dir(settings: Settings) -> Path:
    """The embedded worker's work directory: ``<data dir>/worker``, inside the folder the user
    gave (its runs' sandboxes never show the rest of the data directory: the worker is told
    to hide it). A work directory an older serve kept beside the data directory
    (``<data dir>-worker``: the node's key, the dataset cache) is moved in on first use."""
    data_dir = settings.data_dir.absolute()
    inside = data_dir / "worker"
    beside = data_dir.with_name(f"{data_dir.name}-worker")
    if not inside.exists() and beside.is_dir() and not beside.is_symlink():
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            os.rename(beside, inside)
            log.info("moved the local worker's folder %s into the data directory (%s)", beside, inside)
        except OSError as exc:
            log.warning(
                "could not move the local worker's folder %s into %s (%s): using it there",
                beside,
                inside,
                exc,
            )
            return beside
    return inside


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # If `serve` is killed outright, its worker must not outlive it (Linux only).
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalWorker:
    """The worker agent child process of ``serve --with-worker``."""

    def __init__(
        self,
        api_url: str,
        token: str,
        name: str,
        slots: int,
        work_dir: Path,
        log_path: Path,
        data_dir: Path | None = None,
    ) -> None:
        self.data_dir = data_dir  # the service's, hidden from every run (None: none to hide)
        self.api_url = api_url
        self.token = token
        self.name = name
        self.slots = slots
        self.work_dir = work_dir
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._stopping = False

    def command(self) -> list[str]:
        return [
            # -P: the folder serve started in (which usually holds the data directory) is not
            # on the worker's module path, so nothing of it reaches what runs its jobs.
            sys.executable, "-P", "-m", "torchyard.cli", "worker",
            "--api", self.api_url,
            "--name", self.name,
            "--slots", str(self.slots),
            "--work-dir", str(self.work_dir),
            # After a quick restart, the previous serve's worker may still be stopping its runs.
            "--wait-for-node", str(LOCAL_WORKER_NODE_WAIT_S),
        ]  # fmt: skip

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The worker's environment: serve's, with the token (in the environment, not on the
        command line, visible in ``ps``) and the data directory named hidden from its runs."""
        source = os.environ if base is None else base
        # The object store's credentials are the API's alone (docs/storage.md): the worker and
        # its runs move artifacts with presigned URLs and never see them.
        env = {k: v for k, v in source.items() if not is_storage_credential(k)}
        env["TORCHYARD_TOKEN"] = self.token
        # The service's data directory (tokens, database, artifacts) is never shown to a run,
        # wherever it lies (worker.agent.sandbox).
        if self.data_dir is not None:
            hidden = [p for p in env.get(SANDBOX_HIDE_VARIABLE, "").split(os.pathsep) if p]
            env[SANDBOX_HIDE_VARIABLE] = os.pathsep.join([*hidden, str(self.data_dir.absolute())])
        return env

    def start(self) -> None:
        cmd = self.command()
        env = self.environment()
        log.info("starting the local worker agent %r (log: %s)", self.name, self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                cmd,
                env=env,
                cwd=self.work_dir,  # a fixed folder of its own, not wherever serve started
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches `serve`, which stops the worker in order
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        threading.Thread(target=self._watch, name="local-worker-watch", daemon=True).start()

    def _watch(self) -> None:
        process = self.process
        if process is None:
            return
        code = process.wait()
        if not self._stopping:
            log.error("the local worker agent exited with status %s; see %s", code, self.log_path)

    def stop(self, grace: float = WORKER_STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (the agent stops its ranks on SIGTERM)."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        self._stopping = True
        log.info("stopping the local worker agent")
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("the local worker agent did not stop within %.0f s: killing it", grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class _Server(uvicorn.Server):
    """uvicorn that, on a stop signal, first runs ``before_exit`` (in a thread), then exits."""

    def __init__(self, config: uvicorn.Config, before_exit: Any = None) -> None:
        super().__init__(config)
        self._before_exit = before_exit
        self._exiting = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._before_exit is None or self._exiting:
            super().handle_exit(sig, frame)
            return
        self._exiting = True
        self._captured_signals.append(sig)

        def stop_then_exit() -> None:
            try:
                self._before_exit()
            finally:
                self.should_exit = True

        threading.Thread(target=stop_then_exit, name="serve-stop", daemon=True).start()


def _start_api_processes(settings: Settings, sock: socket.socket, count: int, log_level: str) -> list[int]:
    """``count`` more API processes serving ``sock`` (forked: they share the listening socket, and
    the kernel hands each connection to one of them). Each is a replica of its own (its
    scheduling loop, wake-ups and reaper clock, coordinated through PostgreSQL), and dies
    with this process."""
    from service.api.app import create_app

    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child serves until stopped, then exits
            code = 0
            try:
                _die_with_parent()
                config = uvicorn.Config(
                    create_app(settings, freeze=True),
                    log_level=log_level,
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                    # The app reads X-Forwarded-* itself, from TORCHYARD_TRUSTED_PROXIES only.
                    proxy_headers=False,
                )
                uvicorn.Server(config).run(sockets=[sock])
            except BaseException:
                log.exception("an API process failed")
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    return pids


def _stop_api_processes(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def serve(
    settings: Settings,
    *,
    with_worker: bool = False,
    worker_name: str | None = None,
    worker_slots: int | None = None,
    log_level: str = "info",
    workers: int = 1,
) -> int:
    """Run the API (and, with ``with_worker``, a local worker agent) until SIGINT/SIGTERM.

    ``workers`` > 1 (PostgreSQL only) serves the address from that many API processes."""
    configure_logging(log_level)
    if sys.platform.startswith("linux"):
        refuse_inspection()
    from service.api.app import bootstrap, create_app

    if workers > 1:
        if settings.sqlalchemy_url.startswith("sqlite"):
            log.error(
                "--workers %d needs PostgreSQL (TORCHYARD_DATABASE_URL): on SQLite one API process "
                "serves the data directory",
                workers,
            )
            return 2
        # Migrations once, before the processes start (each one's start then finds them done).
        bootstrap(settings).dispose()

    worker: LocalWorker | None = None
    if with_worker:
        token = ensure_worker_token(settings)
        name = worker_name or f"{socket.gethostname().split('.')[0] or 'local'}-local"
        worker = LocalWorker(
            _local_api_url(settings.host, settings.port),
            token,
            name,
            worker_slots or default_worker_slots(),
            worker_dir(settings),
            settings.data_dir / "logs" / "local-worker.log",
            data_dir=settings.data_dir,
        )
    sock = _bind(settings.host, settings.port)
    others = _start_api_processes(settings, sock, workers - 1, log_level) if workers > 1 else []
    config = uvicorn.Config(
        create_app(settings, freeze=True),
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        # The app reads X-Forwarded-* itself, from TORCHYARD_TRUSTED_PROXIES only.
        proxy_headers=False,
    )
    server = _Server(config, before_exit=worker.stop if worker is not None else None)
    # uvicorn re-raises the stop signal once it has shut down; these handlers make that a
    # plain return, so the worker is always reaped below.
    stopped: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda s, _f: stopped.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        if worker is not None:
            worker.start()
        log.info("torchyard API on %s", _local_api_url(settings.host, settings.port))
        server.run(sockets=[sock])
    finally:
        if worker is not None:
            worker.stop()
        _stop_api_processes(others)
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
