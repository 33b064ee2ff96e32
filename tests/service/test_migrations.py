"""The schema exists only through Alembic: upgrade from empty works and head equals the models."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from service.db.migrate import alembic_config, upgrade
from service.db.models import Base
from tests.conftest import PG_ADMIN_URL

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[str]:
    """A database with no tables at all."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/empty.db"
        return
    request.getfixturevalue("pg_database")  # skips or fails with the shared message when absent
    name = f"torchyard_mig_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield admin.url.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def test_upgrade_from_empty_and_head_matches_models(empty_db: str) -> None:
    upgrade(empty_db)
    upgrade(empty_db)  # idempotent: a second start changes nothing
    engine = sa.create_engine(empty_db)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
        head = ScriptDirectory.from_config(alembic_config(empty_db)).get_current_head()
        assert ctx.get_current_revision() == head
        tables = set(sa.inspect(conn).get_table_names())
    engine.dispose()
    assert {t.name for t in Base.metadata.sorted_tables} <= tables


def test_downgrade_to_base_and_back(empty_db: str) -> None:
    upgrade(empty_db)
    cfg = alembic_config(empty_db)
    command.downgrade(cfg, "base")
    engine = sa.create_engine(empty_db)
    with engine.connect() as conn:
        assert set(sa.inspect(conn).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    upgrade(empty_db)


def test_single_head() -> None:
    assert len(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()) == 1


def test_metric_counts_are_filled_in_for_the_jobs_already_there(empty_db: str) -> None:
    """0014 counts each job's stored points and names on its row (the per-job limits start
    from them)."""
    upgrade(empty_db, "0013")
    engine = sa.create_engine(empty_db)
    at = "2026-11-01 00:00:00+00:00"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tokens (id, name, role, token_hash, created_at) VALUES ('t1', 'u', 'user', 'h', :at)"
            ),
            {"at": at},
        )
        for job_id in ("j1", "j2"):
            conn.execute(
                sa.text(
                    "INSERT INTO jobs (id, owner_id, name, status, type, spec, node_count, "
                    "process_count_per_node, priority, attempts_count, created_at, updated_at) "
                    "VALUES (:id, 't1', 'n', 'running', 'evaluate', '{}', 1, 1, 0, 1, :at, :at)"
                ),
                {"id": job_id, "at": at},
            )
        conn.execute(
            sa.text(
                "INSERT INTO attempts (id, job_id, number, status, master_addr, master_port, created_at) "
                "VALUES ('a1', 'j1', 1, 'running', '127.0.0.1', 29500, :at)"
            ),
            {"at": at},
        )
        for seq, (name, step) in enumerate([("loss", 0), ("loss", 1), ("loss", 2), ("lr", 0), ("lr", 1)], 1):
            conn.execute(
                sa.text(
                    "INSERT INTO metrics (seq, job_id, attempt_id, name, value, epoch, step, rank, time) "
                    "VALUES (:seq, 'j1', 'a1', :name, 1.0, 0, :step, 0, :at)"
                ),
                {"seq": seq, "name": name, "step": step, "at": at},
            )
    engine.dispose()
    upgrade(empty_db)
    engine = sa.create_engine(empty_db)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, metric_points, metric_names, metrics_dropped FROM jobs ORDER BY id")
        ).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("j1", 5, 2, 0), ("j2", 0, 0, 0)]


def test_metric_points_get_occurrence_0_and_several_values_fit_one_step(empty_db: str) -> None:
    """0015 gives the points already stored occurrence 0 and puts it in the key: a second
    value at one step is stored, the same value again (a retried report) is not; going back
    keeps the first value at each step."""
    upgrade(empty_db, "0014")
    engine = sa.create_engine(empty_db)
    at = "2026-11-01 00:00:00+00:00"
    point = (
        "INSERT INTO metrics (job_id, attempt_id, name, value, epoch, step, rank, time{extra}) "
        "VALUES ('j1', 'a1', 'loss', :value, 0, 5, 0, :at{values})"
    )
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tokens (id, name, role, token_hash, created_at) VALUES ('t1', 'u', 'user', 'h', :at)"
            ),
            {"at": at},
        )
        conn.execute(
            sa.text(
                "INSERT INTO jobs (id, owner_id, name, status, type, spec, node_count, process_count_per_node, "
                "priority, attempts_count, created_at, updated_at, metric_points, metric_names) "
                "VALUES ('j1', 't1', 'n', 'running', 'evaluate', '{}', 1, 1, 0, 1, :at, :at, 1, 1)"
            ),
            {"at": at},
        )
        conn.execute(
            sa.text(
                "INSERT INTO attempts (id, job_id, number, status, master_addr, master_port, created_at) "
                "VALUES ('a1', 'j1', 1, 'running', '127.0.0.1', 29500, :at)"
            ),
            {"at": at},
        )
        conn.execute(sa.text(point.format(extra="", values="")), {"value": 1.0, "at": at})
    engine.dispose()
    upgrade(empty_db)
    engine = sa.create_engine(empty_db)
    with engine.begin() as conn:
        conn.execute(sa.text(point.format(extra=", occurrence", values=", 1")), {"value": 2.0, "at": at})
        conn.execute(sa.text("UPDATE jobs SET metric_points = 2"))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.text(point.format(extra=", occurrence", values=", 1")), {"value": 3.0, "at": at})
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT value, occurrence FROM metrics ORDER BY seq")).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [(1.0, 0), (2.0, 1)]
    command.downgrade(alembic_config(empty_db), "0014")
    engine = sa.create_engine(empty_db)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT value FROM metrics")).all()
        counted = conn.execute(sa.text("SELECT metric_points FROM jobs")).scalar_one()
    engine.dispose()
    assert [tuple(r) for r in rows] == [(1.0,)] and counted == 1
