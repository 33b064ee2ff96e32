"""Shared fixtures: real SQLite and PostgreSQL databases, the app, and a live uvicorn server.

PostgreSQL tests use ``TORCHYARD_TEST_POSTGRES_URL`` (default: the local server's
``test`` database). They are skipped with a message when it cannot be reached,
unless ``TORCHYARD_REQUIRE_POSTGRES=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _truncate_pg(url: str) -> None:
    engine = sa.create_engine(url)
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test using this runs once on a fresh SQLite file and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'torchyard.db'}"
    url: str = request.getfixturevalue("pg_database")
    _truncate_pg(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'torchyard.db'}"


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


class LiveServer:
    """uvicorn serving the app on a free loopback port, in a thread of the test process."""

    def __init__(self, settings: Settings, host: str = "127.0.0.1") -> None:
        self.settings = settings
        self.host = host
        self.port = free_port(host)
        config = uvicorn.Config(
            create_app(settings), host=host, port=self.port, log_level="warning", lifespan="on"
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
