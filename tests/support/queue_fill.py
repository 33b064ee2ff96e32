"""A long queue and a large cluster's history, written in bulk with SQL (PostgreSQL), for the
query-plan tests and bench/bench_scale.py: submitting 100,000 jobs one by one through the
API would take most of an hour on a small machine."""

from __future__ import annotations

import sqlalchemy as sa

from service.db.engine import Database
from service.db.models import Dataset, Token
from service.db.types import new_id


def owner_and_dataset(db: Database, token_id: str | None = None) -> tuple[str, str]:
    """A user token (``token_id``, or a new one) and a dataset row the bulk jobs reference."""
    with db.transaction() as s:
        if token_id is None:
            token = Token(name=f"bulk-{new_id()[:8]}", role="user", token_hash=new_id() + new_id())
            s.add(token)
            s.flush()
            token_id = token.id
        ds = Dataset(
            owner_id=token_id,
            name=f"bulk-{new_id()[:8]}",
            source="upload",
            storage_path="unused",
            classes=["a", "b"],
            class_counts={"a": 1, "b": 1},
            num_images=2,
            size_bytes=1,
            sha256="0" * 64,
        )
        s.add(ds)
        s.flush()
        return token_id, ds.id


_JOB_COLUMNS = (
    "id, owner_id, name, status, type, spec, architecture, train_dataset_id, validation_dataset_id, "
    "node_count, process_count_per_node, priority, attempts_count, restarts, created_at, updated_at"
)


def fill_queue(
    db: Database,
    owner: tuple[str, str],
    count: int,
    *,
    node_count: int = 1,
    units: int = 1,
    prefix: str = "q",
) -> None:
    """``count`` queued training jobs (priorities 0-2, oldest first by their number), in one
    statement; created a little in the past, so jobs submitted afterwards queue behind them."""
    spec = '{"model": {"architecture": "resnet18"}, "parameters": {}, "resources": {}}'
    with db.transaction() as s:
        s.execute(
            sa.text(
                f"INSERT INTO jobs ({_JOB_COLUMNS}) "
                "SELECT md5(:prefix || i::text), :owner, :prefix || '-' || i, 'queued', 'train', "
                "CAST(:spec AS json), 'resnet18', :ds, :ds, :nodes, :units, i % 3, 0, 0, "
                "now() - interval '1 hour' + i * interval '1 millisecond', now() "
                "FROM generate_series(1, :count) AS i"
            ),
            {
                "prefix": prefix,
                "owner": owner[0],
                "ds": owner[1],
                "spec": spec,
                "nodes": node_count,
                "units": units,
                "count": count,
            },
        )


def fill_history(db: Database, owner: tuple[str, str], jobs: int, nodes: list[str]) -> None:
    """``jobs`` finished (cancelled) jobs, each with an attempt and a done placement on one of
    ``nodes`` (ids): the history that placements and attempts grow with."""
    with db.transaction() as s:
        params = {"owner": owner[0], "ds": owner[1], "count": jobs, "nodes": nodes}
        s.execute(
            sa.text(
                f"INSERT INTO jobs ({_JOB_COLUMNS}, finished_at) "
                "SELECT md5('h' || i::text), :owner, 'h-' || i, 'cancelled', 'train', "
                "CAST('{}' AS json), 'resnet18', :ds, :ds, 1, 1, 0, 1, 0, "
                "now() - interval '2 hours' + i * interval '1 millisecond', now(), now() "
                "FROM generate_series(1, :count) AS i"
            ),
            params,
        )
        s.execute(
            sa.text(
                "INSERT INTO job_events (job_id, status, message, at) "
                "SELECT md5('h' || i::text), status, 'history', now() - interval '2 hours' "
                "FROM generate_series(1, :count) AS i, (VALUES ('queued'), ('cancelled')) AS e(status)"
            ),
            params,
        )
        s.execute(
            sa.text(
                "INSERT INTO attempts (id, job_id, number, status, master_addr, master_port, created_at) "
                "SELECT md5('a' || i::text), md5('h' || i::text), 1, 'cancelled', "
                "'10.0.' || (i % 250) || '.' || (i % 4), 29500, now() - interval '2 hours' "
                "FROM generate_series(1, :count) AS i"
            ),
            params,
        )
        s.execute(
            sa.text(
                "INSERT INTO placements (id, attempt_id, job_id, node_id, node_rank, units, status, "
                "lease_token, lease_expires_at, created_at, finished_at) "
                "SELECT md5('p' || i::text), md5('a' || i::text), md5('h' || i::text), "
                "(CAST(:nodes AS text[]))[1 + i % cardinality(CAST(:nodes AS text[]))], 0, 1, 'done', "
                "md5('l' || i::text), now() - interval '2 hours', now() - interval '2 hours', now() "
                "FROM generate_series(1, :count) AS i"
            ),
            params,
        )


def add_nodes(db: Database, token_id: str, count: int, *, prefix: str = "sim", units: int = 1) -> list[str]:
    """``count`` nodes registered long ago and silent since (lost to the scheduler); their ids."""
    with db.transaction() as s:
        rows = s.execute(
            sa.text(
                "INSERT INTO nodes (id, name, address, units, accelerator, status, token_id, "
                "registered_at, last_heartbeat_at) "
                "SELECT md5(:prefix || i::text), :prefix || '-' || i, "
                "'10.0.' || (i % 250) || '.' || (i % 4), :units, 'cpu', 'lost', :token, "
                "now() - interval '3 hours', now() - interval '3 hours' "
                "FROM generate_series(1, :count) AS i RETURNING id"
            ),
            {"prefix": prefix, "units": units, "token": token_id, "count": count},
        )
        return [r[0] for r in rows]
