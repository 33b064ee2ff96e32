"""A PostgreSQL server of a test's own, to stop and start at will (database outages).

``initdb`` into a temporary folder owned by the ``postgres`` OS user (initdb and
postgres refuse to run as root), then ``postgres`` on a free loopback port, trust
authentication. :meth:`PrivatePostgres.stop` takes it down (fast shutdown: sessions are
cut, new connections refused), :meth:`PrivatePostgres.start` brings it back on the same
port and data. The shared server other tests use is never touched.

Skipped with a message when the PostgreSQL binaries are not installed, and a failure
instead when ``TORCHYARD_REQUIRE_POSTGRES=1`` (CI).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRE_PG = os.environ.get("TORCHYARD_REQUIRE_POSTGRES") == "1"
PG_USER = "postgres"


def postgres_bin() -> Path | None:
    """The folder holding initdb, postgres and pg_ctl (the newest installed version)."""
    found = shutil.which("pg_ctl")
    if found and Path(found).with_name("initdb").exists():
        return Path(found).parent
    root = Path("/usr/lib/postgresql")
    versions = sorted(
        (p for p in root.glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    return versions[-1] if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PrivatePostgres:
    """One private PostgreSQL server (see the module's docstring)."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="torchyard-pg-"))
        self.data = self.root / "data"
        self.logfile = self.root / "postgres.log"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            entry = pwd.getpwnam(PG_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", PG_USER, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, check=check, timeout=120)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.logfile), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """Take the server down: ``fast`` cuts sessions, ``immediate`` is a crash."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def create_database(self, name: str) -> str:
        import sqlalchemy as sa

        engine = sa.create_engine(self.url(), isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return self.url(name)

    def close(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def start_private_postgres() -> PrivatePostgres:
    """A running private server, or the reason there cannot be one (pytest skip or fail)."""
    bindir = postgres_bin()
    problem = None
    if bindir is None:
        problem = "the PostgreSQL server binaries (initdb, postgres, pg_ctl) are not installed"
    elif os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_USER)
        except KeyError:
            problem = f"running as root and there is no {PG_USER!r} OS user to run PostgreSQL as"
    if problem is not None:
        if REQUIRE_PG:
            pytest.fail(problem + " and TORCHYARD_REQUIRE_POSTGRES=1")
        pytest.skip(problem + ": the database outage tests need a PostgreSQL server of their own")
    assert bindir is not None
    server = PrivatePostgres(bindir)
    server.start()
    return server


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    server = start_private_postgres()
    try:
        yield server
    finally:
        server.close()


def wait_until(condition: object, what: str, timeout: float = 60.0, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not callable(condition) or not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(every)
