"""Shared fixtures: real SQLite and PostgreSQL databases, the app, and a live uvicorn server.

PostgreSQL tests use ``TORCHYARD_TEST_POSTGRES_URL`` (default: the local server's
``test`` database). They are skipped with a message when it cannot be reached,
unless ``TORCHYARD_REQUIRE_POSTGRES=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Under pytest-xdist (``make test``: more test processes than cores), torch in each test
# process computes on one thread: its in-process training then never spins against the
# other processes' work on the same cores. Set before anything imports torch. The ranks the
# agents start get their thread count from the agent (AgentContext.cpus_for: two on a
# 1-slot agent here) and inherit the wait policy: their OpenMP threads sleep while they wait
# for each other instead of spinning, which on two cores kept busy by the suite burns the
# core another process needs (a two-thread resnet18 step beside two busy processes: 7.7
# CPU-s spinning, 2.6 passive; bench/RESULTS.md, the test suite's section).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The test suite's trainer hooks (tests/support/trainer_hooks.py: a rank failed or held where a
# test asks with TORCHYARD_TEST_FAIL_RANK, TORCHYARD_TEST_PAUSE_AT...): every agent, torchrun
# and rank a test starts inherits the setting, and in-process runs read it here.
os.environ.setdefault(
    "TORCHYARD_TRAINER_HOOKS", str(Path(__file__).resolve().parent / "support" / "trainer_hooks.py")
)

import pytest
import sqlalchemy as sa
import uvicorn
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.config import Settings
from service.db.migrate import upgrade
from service.db.models import Base

PG_ADMIN_URL = os.environ.get(
    "TORCHYARD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REQUIRE_PG = os.environ.get("TORCHYARD_REQUIRE_POSTGRES") == "1"


@contextmanager
def scratch_database(prefix: str) -> Iterator[str]:
    """A new, empty database on the PostgreSQL server of :data:`PG_ADMIN_URL`, dropped on exit
    (for the benchmarks that run ``torchyard serve`` on a database of their own)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _pg_available() -> str | None:
    try:
        engine = sa.create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        engine.dispose()
        return None
    except Exception as exc:  # any driver or network error means "not available"
        return f"{type(exc).__name__}: {exc}".splitlines()[0]


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A PostgreSQL database of this test session's own, migrated to head, dropped at the end."""
    problem = _pg_available()
    if problem is not None:
        message = f"PostgreSQL not reachable at {PG_ADMIN_URL} ({problem})"
        if REQUIRE_PG:
            pytest.fail(message + " and TORCHYARD_REQUIRE_POSTGRES=1")
        pytest.skip(message + "; set TORCHYARD_TEST_POSTGRES_URL to run the PostgreSQL tests")
    name = f"torchyard_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        # A test database need not survive a crash of the server: commits do not wait for the disk.
        conn.execute(sa.text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _reset_pg(url: str) -> None:
    """Empty every table and restart the sequences: ``DELETE`` takes milliseconds on these small
    tables where ``TRUNCATE`` takes 0.2–0.7 s (it rewrites each table's files)."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
        for (name,) in conn.execute(
            sa.text("SELECT sequencename FROM pg_sequences WHERE schemaname = 'public'")
        ):
            conn.execute(sa.text(f'ALTER SEQUENCE "{name}" RESTART'))
    engine.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database migrated to head once per session; each test gets a copy (2 ms, not 0.1–0.8 s)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "torchyard.db"
    upgrade(f"sqlite:///{path}")
    return path


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``db_url`` is SQLite; tests marked ``both_databases`` (where the database makes a
    difference: leases, scheduling, locking, migrations, concurrency, the restart protocol) run
    once on SQLite and once on PostgreSQL."""
    if (
        "db_url" not in metafunc.fixturenames
        or metafunc.definition.get_closest_marker("both_databases") is None
    ):
        return
    if any("db_url" in m.args[0] for m in metafunc.definition.iter_markers("parametrize")):
        return  # the test chose its database itself
    metafunc.parametrize(
        "db_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
    )


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database: a copy of the migrated SQLite template, or the session's PostgreSQL emptied."""
    if getattr(request, "param", "sqlite") == "sqlite":
        sqlite: str = request.getfixturevalue("sqlite_url")
        return sqlite
    url: str = request.getfixturevalue("pg_database")
    _reset_pg(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path, sqlite_template: Path) -> str:
    """A fresh SQLite database, already migrated to head (a copy of the session's template)."""
    path = tmp_path / "torchyard.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


def fast_leases(
    *,
    heartbeat_s: float = 0.5,
    lease_s: float = 3.0,
    reaper_s: float = 0.2,
    ports: tuple[int, int] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Settings for tests where nodes, leases and the reaper act: heartbeats and leases of
    seconds instead of the production minutes, so a lost node is noticed within the test.

    ``ports`` is the module's own rendezvous port range (below the kernel's ephemeral range,
    32768+, where an outgoing connection could take one first)."""
    values: dict[str, Any] = {
        "heartbeat_interval_s": heartbeat_s,
        "lease_timeout_s": lease_s,
        "reaper_interval_s": reaper_s,
    }
    if ports is not None:
        values["master_port_min"], values["master_port_max"] = ports
    values.update(overrides)
    return values


@pytest.fixture
def make_settings(tmp_path: Path, db_url: str) -> Any:
    def factory(**overrides: Any) -> Settings:
        values: dict[str, Any] = {"data_dir": tmp_path / "data", "database_url": db_url}
        values.update(overrides)
        return Settings(**values)

    return factory


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    return make_settings()  # type: ignore[no-any-return]


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """An in-process client of the app (lifespan run: migrations, admin token)."""
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        yield c


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def log_tails(folder: Path, tail: int = 3000) -> str:
    """The end of every ``*.log`` of ``folder``, each under its name (for a failure's message)."""
    parts = []
    for path in sorted(folder.glob("*.log")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
    return "\n".join(parts)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (all held open until each is known)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind((host, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


# How long a live server's stop waits for the requests still open before it cancels them.
# At a test's end these are the claims its SIGKILLed agents left parked: a parked claim looks
# for its agent's disconnect only every few seconds, and uvicorn's default waits for it
# (3-5 s of every end-to-end test's teardown).
STOP_GRACE_S = 1


class LiveServer:
    """uvicorn serving the app on a free loopback port, in a thread of the test process."""

    def __init__(self, settings: Settings, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.settings = settings
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(
            create_app(settings),
            host=host,
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=STOP_GRACE_S,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_token(self) -> str:
        return self.settings.admin_token_path.read_text().strip()

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture
def live_server(settings: Settings) -> Iterator[LiveServer]:
    server = LiveServer(settings).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A small model trained in-process once per run (tests/support/trained_model.py): under
    pytest-xdist, in a folder of this run's beside the test processes' own (their basetemps'
    parent, which a given --basetemp keeps from run to run), by the first that needs it. Tests
    only read its files."""
    from tests.support.trained_model import shared_trained_model

    root = tmp_path_factory.getbasetemp() / "trained-model"
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if os.environ.get("PYTEST_XDIST_WORKER") and run:
        root = tmp_path_factory.getbasetemp().parent / f"trained-model-{run}"
    return shared_trained_model(root)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private S3 server (SeaweedFS, tests/support/s3_server.py), one per test process,
    started by the first test that asks for it; skipped where ``weed`` is missing unless
    ``TORCHYARD_REQUIRE_S3=1``."""
    from tests.support.s3_server import S3Server, require_s3

    require_s3()
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, not in pyproject.toml, whose hash keys CI's cached environment.
    config.addinivalue_line(
        "markers", "serial: runs after the parallel part of `make test`, alone (tests/README.md)"
    )


def _weight(item: pytest.Item) -> int:
    """Scheduling order: the modules that start real training processes first, so that none
    of them is left to run alone at the end of a parallel run."""
    path = Path(str(item.path))
    if "e2e" in path.parts or item.get_closest_marker("slow") is not None:
        return 0
    return 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``--dist loadfile --no-loadscope-reorder``) a
    module's tests run on one test process, one after another, so its module-scoped servers,
    agents and trained models are built once; modules run in parallel with each other, taken
    in this order. (``loadgroup`` cannot do this with pytest 9: the group it appends to a
    test's id no longer reaches the scheduler.)"""
    items.sort(key=_weight)  # stable: a module's tests stay together and in order
