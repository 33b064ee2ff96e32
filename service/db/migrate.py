"""Running the Alembic migrations from code (``torchyard db upgrade`` and ``serve`` start)."""

from __future__ import annotations

import functools
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@functools.cache
def _heads() -> frozenset[str]:
    """The revisions at the head of the migrations (read, and their files compiled, once per
    process: about 30 ms each time)."""
    return frozenset(ScriptDirectory.from_config(alembic_config("")).get_heads())


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision``; safe to call on every start. A database
    already at the head (every start but the first after a release) is only looked at."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            if url.startswith("postgresql"):
                # Serialise concurrent upgrades from several replicas starting together.
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7345001)")
            if revision == "head" and set(MigrationContext.configure(conn).get_current_heads()) == _heads():
                return
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()
