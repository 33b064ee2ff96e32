"""Running the Alembic migrations from code (``torchyard db upgrade`` and ``serve`` start)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision``; safe to call on every start."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            if url.startswith("postgresql"):
                # Serialise concurrent upgrades from several replicas starting together.
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7345001)")
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()
