"""Engines and sessions.

SQLite (the embedded default) runs in WAL mode with a busy timeout. Writing
sessions open their transaction with ``BEGIN IMMEDIATE`` so that two writers queue
on the busy timeout instead of failing with "database is locked" when a deferred
transaction tries to upgrade its lock; read-only sessions use a plain ``BEGIN``
and never block writers. PostgreSQL uses one pool for both.

Nothing waits on an unreachable database for long: PostgreSQL connections give up after
``connect_timeout_s``, a statement after ``statement_timeout_s``, a dead peer is noticed
by TCP keepalives, and a request waits at most ``pool_timeout_s`` for a pooled
connection. What fails then becomes a 503 ``ServiceUnavailableError`` (see
:func:`is_unavailable`), never a 500 or a hang.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

SQLITE_BUSY_TIMEOUT_MS = 60_000
DEFAULT_CONNECT_TIMEOUT_S = 3.0
DEFAULT_STATEMENT_TIMEOUT_S = 30.0
DEFAULT_POOL_TIMEOUT_S = 5.0
# PostgreSQL connections per pool: kept open, and at most (see Database).
POSTGRES_POOL_SIZE = 25
POSTGRES_POOL_MAX = 50


def is_unavailable(exc: BaseException) -> bool:
    """The database could not be reached or did not answer in time (as opposed to a query
    it refused): a connection refused, dropped or timed out, a statement cancelled by its
    timeout, no pooled connection free in time."""
    if isinstance(exc, PoolTimeoutError | OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def postgres_connect_args(connect_timeout_s: float, statement_timeout_s: float) -> dict[str, Any]:
    """libpq settings that bound every wait on the server."""
    args: dict[str, Any] = {
        "connect_timeout": max(1, round(connect_timeout_s)),
        # A server that vanished without closing its sockets is noticed within ~15 s.
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": 15_000,
    }
    if statement_timeout_s > 0:
        args["options"] = f"-c statement_timeout={round(statement_timeout_s * 1000)}"
    return args


def _sqlite_engine(url: str, begin_sql: str) -> Engine:
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        pool_size=8,
        max_overflow=32,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, decide when transactions begin.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        # journal_mode is not set here: WAL is a property of the file, set once by
        # Database(); asking for it on every new connection takes a lock, and a burst of
        # new connections then queues on the busy timeout.
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql(begin_sql)

    return engine


def _enable_wal(url: str) -> None:
    """Put the SQLite file in WAL mode (persistent: once per file is enough)."""
    engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    finally:
        engine.dispose()


class Database:
    """The service's handle on its SQL store."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        statement_timeout_s: float = DEFAULT_STATEMENT_TIMEOUT_S,
        pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            _enable_wal(url)
            self.engine = _sqlite_engine(url, "BEGIN IMMEDIATE")
            self.read_engine = _sqlite_engine(url, "BEGIN")
        else:
            self.engine = create_engine(
                url,
                # Kept open: the worker lanes' threads (heartbeats, claims), the scheduler and
                # a burst of requests at once. A connection opened beyond them is closed when
                # returned, and a new PostgreSQL backend costs milliseconds of both sides' CPU:
                # a pool smaller than the steady concurrency opens and closes them all the time.
                pool_size=POSTGRES_POOL_SIZE,
                max_overflow=POSTGRES_POOL_MAX - POSTGRES_POOL_SIZE,
                pool_pre_ping=True,
                pool_timeout=pool_timeout_s,
                connect_args=postgres_connect_args(connect_timeout_s, statement_timeout_s),
            )
            self.read_engine = self.engine
        self._writer = sessionmaker(self.engine, expire_on_commit=False)
        self._reader = sessionmaker(self.read_engine, expire_on_commit=False)

    def session(self) -> Session:
        """A session for work that writes (its transaction takes the write lock on SQLite)."""
        return self._writer()

    def read_session(self) -> Session:
        """A session for reads only."""
        return self._reader()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A writing session whose transaction commits on success and rolls back on error."""
        with self._writer() as session, session.begin():
            yield session

    def ping(self) -> None:
        """One round trip to the database; raises when it cannot be reached."""
        with self.read_engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def dispose(self) -> None:
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()
