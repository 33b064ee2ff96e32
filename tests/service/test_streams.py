"""Followers: server-sent events and logs?follow=true, over real HTTP, on SQLite and PostgreSQL.

A scripted agent drives a job through the real worker routes (claim, status, reports)
while followers read its stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import LiveServer
from tests.support.factories import auth, create_token, insert_dataset, job_spec, token_id
from tests.support.fake_agent import FakeAgent
from torchyard.client import Client, Event
from torchyard.contract.errors import AuthenticationError, NotFoundError, RequestValidationError

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


class Setup:
    def __init__(self, server: LiveServer, settings: Settings) -> None:
        self.server = server
        self.admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=30)
        me = token_id(self.admin, server.admin_token)
        self.train = insert_dataset(settings, me, name="train", classes=["a", "b"])
        self.val = insert_dataset(settings, me, name="val", classes=["a", "b"])
        self.agent = FakeAgent(server.url, create_token(self.admin, "worker"))
        self.client = Client(server.url, server.admin_token)

    def submit(self, **overrides: Any) -> str:
        r = self.admin.post("/v1/jobs", json=job_spec(self.train, self.val, **overrides))
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        return job_id

    def close(self) -> None:
        self.admin.close()
        self.agent.close()
        self.client.close()


@pytest.fixture
def setup(live_server: LiveServer, settings: Settings) -> Iterator[Setup]:
    s = Setup(live_server, settings)
    yield s
    s.close()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a thread; its result (or exception) lands in the returned list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # surfaced by the test's assertions
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def run_job(setup: Setup, job_id: str, *, chunks: int = 5, epochs: int = 2, pause: float = 0.02) -> str:
    """Claim the job, make it run, report metrics and log lines, and fail it; the rank-0 text."""
    placement = setup.agent.claim()
    assert placement["job_id"] == job_id
    setup.agent.status(placement, "running")
    text = ""
    offset = 0
    for epoch in range(1, epochs + 1):
        for i in range(chunks):
            line = f"epoch {epoch} line {i} ünïcode\n"
            offset = setup.agent.log(placement, "rank-0", offset, line)
            text += line
            setup.agent.metric(placement, "train.loss", 1.0 / (epoch * 10 + i + 1), epoch, epoch * 100 + i)
            time.sleep(pause)
        setup.agent.metric(placement, "val.loss", 0.5 / epoch, epoch, epoch * 100 + chunks)
        setup.agent.metric(placement, "epoch.seconds", 1.5, epoch, epoch * 100 + chunks)
    setup.agent.status(
        placement,
        "failed",
        exit_code=1,
        failure={"code": "RankFailedError", "message": "rank 0 raised", "rank": 0, "node": setup.agent.name},
    )
    return text


def collect(client: Client, job_id: str, **kwargs: Any) -> list[Event]:
    return list(client.events(job_id, **kwargs))


def by_kind(events: list[Event]) -> dict[str, list[int]]:
    """The seqs of each kind in delivery order: kinds are ordered among themselves, while
    how they interleave depends on when a follower read them."""
    out: dict[str, list[int]] = {}
    for e in events:
        out.setdefault(e.kind, []).append(e.data.get("seq", -1))
    return out


def test_events_follow_a_job_until_its_final_status(setup: Setup) -> None:
    job_id = setup.submit()
    thread, out = in_thread(lambda: collect(setup.client, job_id))
    time.sleep(0.3)
    run_job(setup, job_id)
    thread.join(30)
    assert not thread.is_alive(), "the event stream did not end with the job"
    events: list[Event] = out[0]
    kinds = [e.kind for e in events]
    assert kinds[-1] == "status" and events[-1].data["status"] == "failed"
    final = events[-1].data
    assert final["final"] is True and final["failure"]["code"] == "RankFailedError"
    statuses = [e.data["status"] for e in events if e.kind == "status"]
    assert statuses == ["queued", "scheduled", "running", "failed"]
    metrics = [e.data for e in events if e.kind == "metric"]
    assert len(metrics) == 2 * (5 + 2)
    assert [m["seq"] for m in metrics] == sorted(m["seq"] for m in metrics)
    logs = [e.data for e in events if e.kind == "log"]
    assert "".join(item["text"] for item in logs if item["stream"] == "rank-0").count("\n") == 10
    # every event has an id, and ids never repeat
    ids = [e.id for e in events]
    assert all(ids) and len(set(ids)) == len(ids)
    # the status "running" comes before the first metric point
    assert kinds.index("metric") > kinds.index("status", 2)
    # filters, and errors as the API's codes
    only_status = collect(setup.client, job_id, metrics=False, logs=False)
    assert [e.kind for e in only_status] == ["status"] * 4
    no_logs = collect(setup.client, job_id, logs=False)
    assert {e.kind for e in no_logs} == {"status", "metric"}
    with pytest.raises(RequestValidationError):
        collect(setup.client, job_id, last_event_id="not-an-id")
    with pytest.raises(NotFoundError):
        collect(setup.client, "0" * 32)
    user = create_token(setup.admin, "user")
    with Client(setup.server.url, user) as other, pytest.raises(NotFoundError):
        collect(other, job_id)


def test_last_event_id_resumes_without_gaps_or_duplicates(setup: Setup) -> None:
    job_id = setup.submit()
    # A follower that disconnects mid-job and resumes from the last id it saw.
    first_part: list[Event] = []

    def follow_then_drop() -> None:
        for event in setup.client.events(job_id):
            first_part.append(event)
            if sum(e.kind == "metric" for e in first_part) == 4:
                return  # closes the connection

    thread, _ = in_thread(follow_then_drop)
    run_job(setup, job_id, pause=0.05)
    thread.join(30)
    rest = collect(setup.client, job_id, last_event_id=first_part[-1].id)
    full = collect(setup.client, job_id)
    assert by_kind(first_part + rest) == by_kind(full)
    assert len(first_part + rest) == len(full)
    assert (first_part + rest)[-1].data["status"] == "failed"
    # resuming from every position of the finished job gives exactly the remainder
    for cut in range(0, len(full) - 1, 3):
        resumed = collect(setup.client, job_id, last_event_id=full[cut].id)
        assert by_kind(full[: cut + 1] + resumed) == by_kind(full)
        assert len(full[: cut + 1] + resumed) == len(full)
        assert resumed[-1].data["final"] is True
    # after the final event, a resume gets one "end" event and stops
    after_end = collect(setup.client, job_id, last_event_id=full[-1].id)
    assert [e.kind for e in after_end] == ["end"]


def test_logs_follow_streams_text_until_the_job_ends(setup: Setup) -> None:
    job_id = setup.submit()
    thread, out = in_thread(lambda: "".join(setup.client.follow_logs(job_id, rank=0)))
    offset_thread, offset_out = in_thread(lambda: "".join(setup.client.follow_logs(job_id, rank=0, offset=7)))
    time.sleep(0.3)
    text = run_job(setup, job_id)
    thread.join(30)
    offset_thread.join(30)
    assert not thread.is_alive() and not offset_thread.is_alive(), "logs -f did not end with the job"
    assert out == [text]
    assert offset_out == [text.encode()[7:].decode()]
    # a follow started after the job ended returns the whole text at once
    assert "".join(setup.client.follow_logs(job_id, rank=0)) == text


def test_a_revoked_token_ends_its_open_streams(setup: Setup) -> None:
    job_id = setup.submit()
    placement = setup.agent.claim()
    setup.agent.status(placement, "running")
    setup.agent.log(placement, "rank-0", 0, "first line\n")
    secret = create_token(setup.admin, "admin", "leaving")
    with Client(setup.server.url, secret) as leaving:
        logs, logs_out = in_thread(lambda: "".join(leaving.follow_logs(job_id, rank=0)))
        events, events_out = in_thread(lambda: list(leaving.events(job_id, metrics=False)))
        raw = httpx.Client(base_url=setup.server.url, headers=auth(secret), timeout=60)
        with raw.stream("GET", f"/v1/jobs/{job_id}/events") as opened:
            assert opened.status_code == 200
            time.sleep(0.5)
            assert logs.is_alive() and events.is_alive()  # the job runs on: they wait for more
            r = setup.admin.delete(f"/v1/tokens/{token_id(setup.admin, secret)}")
            assert r.status_code == 200, r.text
            # Each open stream ends although the job is still running; nothing more comes.
            body = b"".join(opened.iter_bytes())
        raw.close()
        logs.join(30)
        events.join(30)
        assert not logs.is_alive() and not events.is_alive(), "a revoked token's streams went on"
    assert b"first line" in body and b"final" not in body
    assert setup.admin.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
    # Reconnecting (the clients try) is refused: the token is revoked.
    for out in (logs_out, events_out):
        assert out and (isinstance(out[0], AuthenticationError) or "final" not in str(out[0])), out


def test_many_followers_share_one_poll_and_hold_no_connection(setup: Setup) -> None:
    job_id = setup.submit()
    app: Any = setup.server.server.config.app
    db = app.state.db
    threads = [in_thread(lambda: collect(setup.client, job_id)) for _ in range(10)]
    threads += [in_thread(lambda: "".join(setup.client.follow_logs(job_id))) for _ in range(10)]
    hub = app.state.stream_hub
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        feed = hub.feeds.get(job_id)
        if feed is not None and feed.subscribers == 20:
            break
        time.sleep(0.1)
    assert hub.feeds[job_id].subscribers == 20  # one shared poller for all of them
    time.sleep(0.5)  # their catch-up reads of the job's history are over
    # 20 streaming clients, and at most the odd short query (the shared poll, the reaper) in flight
    in_use = []
    for _ in range(10):
        in_use.append(
            db.read_engine.pool.checkedout()
            + (0 if db.engine is db.read_engine else db.engine.pool.checkedout())
        )
        time.sleep(0.05)
    assert min(in_use) <= 3, in_use  # pinned connections would show 20 in every sample
    text = run_job(setup, job_id, pause=0)
    results = []
    for thread, out in threads:
        thread.join(30)
        assert not thread.is_alive()
        results.append(out[0])
    keys = [[(e.kind, e.id) for e in r] for r in results[:10]]
    assert all(k == keys[0] for k in keys) and keys[0][-1][0] == "status"
    assert results[10:] == [text] * 10


def test_a_follower_sees_writes_made_through_another_replica(setup: Setup, settings: Settings) -> None:
    """Two API processes on one database: the agent talks to one, the follower to the other."""
    other = LiveServer(settings).start()
    try:
        job_id = setup.submit()
        with Client(other.url, other.admin_token) as follower:
            thread, out = in_thread(lambda: collect(follower, job_id))
            text_thread, text_out = in_thread(lambda: "".join(follower.follow_logs(job_id)))
            time.sleep(0.3)
            text = run_job(setup, job_id)
            thread.join(30)
            text_thread.join(30)
        assert not thread.is_alive() and not text_thread.is_alive()
        assert out[0][-1].data["status"] == "failed"
        assert sum(e.kind == "metric" for e in out[0]) == 14
        assert text_out == [text]
    finally:
        other.stop()


def test_followers_behind_a_small_buffer_catch_up_in_pages(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a buffer far smaller than the job's history and short database pages,
    live followers, slow ones and late ones still get everything exactly once."""
    from service.services import streams

    monkeypatch.setattr(streams, "BUFFER_ITEMS", 8)
    monkeypatch.setattr(streams, "READ_LIMIT", 5)
    job_id = setup.submit()

    def slow() -> list[Event]:
        got = []
        for event in setup.client.events(job_id):
            got.append(event)
            time.sleep(0.05)  # falls behind the buffer while the job reports
        return got

    live, live_out = in_thread(lambda: collect(setup.client, job_id))
    lagging, lagging_out = in_thread(slow)
    text_thread, text_out = in_thread(lambda: "".join(setup.client.follow_logs(job_id)))
    time.sleep(0.3)
    text = run_job(setup, job_id, chunks=8, epochs=2, pause=0)
    for thread in (live, lagging, text_thread):
        thread.join(60)
        assert not thread.is_alive()
    late = collect(setup.client, job_id)  # a long history: read in pages of 5
    expected = by_kind(late)
    assert len(expected["metric"]) == 2 * (8 + 2) and len(expected["log"]) == 16
    for events in (live_out[0], lagging_out[0]):
        assert by_kind(events) == expected
        assert events[-1].data["status"] == "failed"
    assert text_out == [text]
    middle = late[len(late) // 2]
    resumed = collect(setup.client, job_id, last_event_id=middle.id)
    assert by_kind(late[: len(late) // 2 + 1] + resumed) == expected


def test_writes_made_here_wake_the_feeds_at_once(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A status change (the ORM's flush), a metric point and a log chunk (the reports' bulk
    inserts) written through this process nudge the job feeds as their transaction ends;
    a write to no followed table (a job's tags) does not."""
    hub = setup.server.server.config.app.state.stream_hub
    nudges: list[float] = []
    monkeypatch.setattr(hub, "nudge", lambda: nudges.append(time.monotonic()))

    def nudged_by(write: Callable[[], Any]) -> bool:
        nudges.clear()
        write()
        return bool(nudges)

    assert nudged_by(setup.submit)
    placement = setup.agent.claim()
    assert nudged_by(lambda: setup.agent.status(placement, "running"))
    assert nudged_by(lambda: setup.agent.metric(placement, "train.loss", 1.0, 1, 1))
    assert nudged_by(lambda: setup.agent.log(placement, "rank-0", 0, "a line\n"))
    job_id = placement["job_id"]
    assert not nudged_by(lambda: setup.admin.patch(f"/v1/jobs/{job_id}", json={"tags": ["x"]}))
