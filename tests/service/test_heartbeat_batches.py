"""Heartbeats made together (service/api/heartbeats.py): one transaction for the heartbeats
that arrive together, and each its own answer or error.

Real databases (SQLite and PostgreSQL), nodes registered over real HTTP; the batch is made
by the function the route runs, and over HTTP by the live server's own batcher."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import event, select, update

from service.api.heartbeats import Beat, make_beats
from service.config import Settings
from service.db.engine import Database
from service.db.models import Node, Placement
from service.db.types import utcnow
from service.states import NodeStatus
from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, create_token
from tests.support.report_helpers import set_placement, start_running_job
from torchyard.contract.errors import (
    AuthenticationError,
    NodeNameInUseError,
    NotFoundError,
    PermissionDeniedError,
)
from torchyard.contract.protocol import HeartbeatResponse

pytestmark = pytest.mark.both_databases

LEASE_S = 600.0


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(**fast_leases(lease_s=LEASE_S))
    return s


@pytest.fixture
def admin(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30) as c:
        yield c


def _key(name: str) -> str:
    """The agent key of node ``name`` in these tests (16 characters at least)."""
    return f"agent-key-of-{name}".ljust(16, "-")


def _register(admin: httpx.Client, token: str, name: str) -> None:
    body = {"name": name, "address": "127.0.0.1", "units": 1, "accelerator": "cpu", "agent_key": _key(name)}
    r = admin.post("/v1/worker/nodes", json=body, headers=auth(token))
    assert r.status_code == 200, r.text


def _heartbeats(settings: Settings) -> dict[str, Any]:
    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as s:
            return {n.name: n.last_heartbeat_at for n in s.scalars(select(Node))}
    finally:
        db.dispose()


class Commits:
    """Counts the commits made through ``db``."""

    def __init__(self, db: Database) -> None:
        self.count = 0
        event.listen(db.engine, "commit", self._commit)

    def _commit(self, _conn: Any) -> None:
        self.count += 1


def test_heartbeats_made_together_commit_once_and_each_gets_its_own_answer(
    settings: Settings, admin: httpx.Client
) -> None:
    job = start_running_job(settings, admin, node_count=1, per_node=1)
    worker = job.worker_token
    user = create_token(admin, "user")
    for name in ("b", "c", "gone"):
        _register(admin, worker, name)
    past = utcnow() - timedelta(seconds=3 * LEASE_S)
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as s:  # a node heard a minute ago, and one the reaper declared lost
            minute_ago = utcnow() - timedelta(seconds=60)
            s.execute(update(Node).where(Node.name == job.node_names[0]).values(last_heartbeat_at=minute_ago))
            s.execute(
                update(Node)
                .where(Node.name == "gone")
                .values(status=NodeStatus.LOST.value, last_heartbeat_at=past)
            )
        soon = utcnow() + timedelta(seconds=5)
        set_placement(settings, job.placement_ids[0], lease_expires_at=soon)
        before = _heartbeats(settings)
        beats = [
            Beat(worker, job.node_names[0], None, [job.lease]),  # renews its running placement's lease
            Beat(worker, "b", _key("b")),
            Beat(worker, "c", _key("somebody else")),  # another agent holds c now: 409
            Beat(worker, "nobody", None),  # never registered: 404
            Beat("not-a-token", "b", _key("b")),  # 401
            Beat(user, "b", _key("b")),  # a user token: 403
            Beat(worker, "gone", _key("gone")),  # back from lost
        ]
        commits = Commits(db)
        outcomes = make_beats(db, settings, beats)
    finally:
        db.dispose()

    assert commits.count == 1, "the batch was not made in one transaction"
    first, b, c, nobody, bad_token, user_token, gone = outcomes
    assert isinstance(first, tuple) and isinstance(first[0], HeartbeatResponse), first
    assert [r.lease_token for r in first[0].renewed] == [job.lease] and first[0].stop == []
    assert first[0].renewed[0].lease_expires_at > soon + timedelta(seconds=LEASE_S / 2)
    assert isinstance(b, tuple) and b[0].status == NodeStatus.READY.value and b[1] is False
    assert isinstance(c, NodeNameInUseError), c
    assert isinstance(nobody, NotFoundError), nobody
    assert isinstance(bad_token, AuthenticationError), bad_token
    assert isinstance(user_token, PermissionDeniedError), user_token
    assert isinstance(gone, tuple) and gone[0].status == NodeStatus.READY.value and gone[1] is True

    after = _heartbeats(settings)
    for name in (job.node_names[0], "b", "gone"):
        assert after[name] > before[name], name
    assert after["c"] == before["c"], "a refused heartbeat wrote nothing"
    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as s:
            expires = s.scalars(
                select(Placement.lease_expires_at).where(Placement.id == job.placement_ids[0])
            ).one()
            status = s.scalars(select(Node.status).where(Node.name == "gone")).one()
    finally:
        db.dispose()
    assert expires > soon.replace(tzinfo=expires.tzinfo) + timedelta(seconds=LEASE_S / 2)
    assert status == NodeStatus.READY.value


def test_concurrent_heartbeats_over_http_share_transactions(
    live_server: LiveServer, admin: httpx.Client
) -> None:
    worker = create_token(admin, "worker")
    names = [f"n{i:02d}" for i in range(40)]
    for name in names:
        _register(admin, worker, name)
    batcher = live_server.server.config.app.state.lanes.heartbeat_batches  # type: ignore[attr-defined]
    batches, beats = batcher.batches, batcher.beats
    codes: dict[str, int] = {}
    start = threading.Barrier(len(names))

    def beat(name: str) -> None:
        with httpx.Client(base_url=live_server.url, headers=auth(worker), timeout=30) as http:
            http.get("/healthz")  # connected before the barrier
            start.wait()
            r = http.post(
                f"/v1/worker/nodes/{name}/heartbeat",
                json={"leases": []},
                headers={"X-Torchyard-Agent-Key": _key(name)},
            )
            codes[name] = r.status_code

    threads = [threading.Thread(target=beat, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert codes == dict.fromkeys(names, 200)
    assert batcher.beats - beats == len(names)
    made = batcher.batches - batches
    assert made <= len(names) // 2, f"{len(names)} heartbeats arriving together took {made} transactions"


def test_a_lease_with_a_nul_character_is_refused_with_422(
    live_server: LiveServer, admin: httpx.Client
) -> None:
    worker = create_token(admin, "worker")
    _register(admin, worker, "n")
    r = admin.post(
        "/v1/worker/nodes/n/heartbeat",
        json={"leases": ["abc\u0000def"]},
        headers={**auth(worker), "X-Torchyard-Agent-Key": _key("n")},
    )
    assert r.status_code == 422, r.text
    assert "NUL" in r.text


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_batch_that_fails_together_is_made_beat_by_beat(settings: Settings, admin: httpx.Client) -> None:
    """A node's row held locked by another transaction past the statement timeout: the batch
    fails as a whole, and each heartbeat is made again alone — the locked node's fails, the
    others are made."""
    worker = create_token(admin, "worker")
    for name in ("a", "b", "locked"):
        _register(admin, worker, name)
    before = _heartbeats(settings)
    db = Database(settings.sqlalchemy_url, statement_timeout_s=1.0)
    holder = sa.create_engine(settings.sqlalchemy_url)
    try:
        with holder.connect() as conn:
            conn.execute(sa.text("SELECT id FROM nodes WHERE name = 'locked' FOR UPDATE"))
            commits = Commits(db)
            outcomes = make_beats(db, settings, [Beat(worker, n, _key(n)) for n in ("a", "locked", "b")])
            conn.rollback()
    finally:
        holder.dispose()
        db.dispose()
    a, locked, b = outcomes
    assert isinstance(a, tuple) and isinstance(b, tuple), outcomes
    assert isinstance(locked, Exception) and "statement timeout" in str(locked), locked
    assert commits.count == 2  # a and b, each alone
    after = _heartbeats(settings)
    assert after["a"] > before["a"] and after["b"] > before["b"]
    assert after["locked"] == before["locked"]
