"""Webhooks (docs/webhooks.md): subscriptions and their 4xx, the events of a user's jobs and
sweeps delivered signed to a real HTTP receiver (checked with ``torchyard.webhooks.verify``),
retries with backoff until a 2xx or the retry window's end, and the receiver's replay check.

The jobs move through the worker's real routes (status reports, the user's cancel) from the
rows a claim leaves (tests/support/report_helpers.py)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from cryptography.fernet import Fernet
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from service.api.app import create_app
from service.config import Settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.db.models import Attempt, Job, Metric, Node, Sweep, SweepTrial, Webhook, WebhookDelivery
from service.db.types import utcnow
from service.services import sweep_rounds, webhook_delivery, webhooks
from service.services.tokens import Principal
from service.services.tokens import create_token as create_token_row
from service.services.webhooks import MAX_WEBHOOKS_PER_USER, key_path
from service.states import Role
from tests.support.factories import auth, create_token, insert_dataset, register_node, token_id
from tests.support.report_helpers import RunningJob, make_script_job, start_running_job
from torchyard.webhooks import EVENTS, WebhookVerificationError, sign, verify

# --------------------------------------------------------------------------- the receiver


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A real HTTP server on a free loopback port: it keeps every request, and answers each
    path with the statuses queued for it (then 200)."""

    server: ThreadingHTTPServer
    received: list[Received] = field(default_factory=list)
    answers: dict[str, list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def at(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]

    def wait_for(self, path: str, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.at(path)
            if len(got) >= count:
                return got
            time.sleep(0.02)
        raise AssertionError(f"{path}: {len(self.at(path))} of {count} deliveries arrived")


@pytest.fixture
def receiver(served: Receiver) -> Receiver:
    """The module's receiver, with nothing received or queued yet."""
    with served.lock:
        served.received.clear()
        served.answers.clear()
    return served


@pytest.fixture(scope="module")
def served() -> Iterator[Receiver]:
    holder: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            rec = holder[0]
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with rec.lock:
                rec.received.append(Received(self.path, dict(self.headers.items()), body))
                queued = rec.answers.get(self.path) or []
                status = queued.pop(0) if queued else 200
            reply = f"answered {status}".encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Receiver(server))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield holder[0]
    server.shutdown()
    server.server_close()


# --------------------------------------------------------------------------- the service


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    """Deliveries looked for every 50 ms, retried after 50 ms doubling, for 1.5 s at most."""
    s: Settings = make_settings(webhook_poll_s=0.05, webhook_backoff_s=0.05, webhook_retry_s=1.5)
    return s


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        yield c


def _subscribe(client: TestClient, token: str, url: str, events: list[str]) -> dict[str, Any]:
    r = client.post("/v1/webhooks", json={"url": url, "events": events}, headers=auth(token))
    assert r.status_code == 201, r.text
    created: dict[str, Any] = r.json()
    return created


def _deliveries(client: TestClient, token: str, webhook_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/webhooks/{webhook_id}/deliveries", headers=auth(token))
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def _wait_deliveries(
    client: TestClient, token: str, webhook_id: str, done: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        items = _deliveries(client, token, webhook_id)
        if done(items) or time.monotonic() > deadline:
            return items
        time.sleep(0.02)


def _verified(secret: str, got: Received) -> dict[str, Any]:
    assert got.headers["Content-Type"] == "application/json"
    return verify(
        secret, got.headers["X-Torchyard-Timestamp"], got.body, got.headers["X-Torchyard-Signature"]
    )


def _status(client: TestClient, job: RunningJob, state: str, **extra: Any) -> None:
    r = client.post(
        "/v1/worker/placements/status", json={"state": state, **extra}, headers=job.worker_headers()
    )
    assert r.status_code == 200, r.text


def _rewind_to_scheduled(settings: Settings, job: RunningJob) -> None:
    """The job as a claim leaves it before its ranks report running."""
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(
                update(Job).where(Job.id == job.job_id).values(status="scheduled", started_at=None)
            )
            session.execute(update(Attempt).where(Attempt.id == job.attempt_id).values(status="scheduled"))
    finally:
        db.dispose()


# --------------------------------------------------------------------------- tests


def test_the_events_of_a_users_jobs_arrive_signed_and_are_logged_delivered(
    client: TestClient, settings: Settings, receiver: Receiver
) -> None:
    user = create_token(client, "user", "ann")
    other = create_token(client, "user", "bob")
    worker = create_token(client, "worker")
    every = _subscribe(client, user, receiver.url("/ann"), list(EVENTS))
    failures = _subscribe(client, user, receiver.url("/ann-failures"), ["job.failed"])
    _subscribe(client, other, receiver.url("/bob"), list(EVENTS))
    assert every["events"] == list(EVENTS) and len(every["secret"]) >= 43

    # started, then succeeded (a script job: its success needs no model upload)
    done = start_running_job(settings, client, user_token=user, worker_token=worker, name="done")
    make_script_job(settings, client, done)
    _rewind_to_scheduled(settings, done)
    _status(client, done, "running")
    _status(client, done, "succeeded", exit_code=0)
    # failed, with a failure that earns no restart
    failed = start_running_job(settings, client, user_token=user, worker_token=worker, name="bad")
    divergence = {"code": "TrainingDivergedError", "message": "the loss became nan"}
    _status(client, failed, "failed", exit_code=1, failure=divergence)
    # cancelled by its owner, then its ranks stopped
    cancelled = start_running_job(settings, client, user_token=user, worker_token=worker, name="stop")
    assert client.post(f"/v1/jobs/{cancelled.job_id}/cancel", headers=auth(user)).status_code == 200
    _status(client, cancelled, "cancelled", exit_code=143)
    # preempted: back to the queue
    preempted = start_running_job(settings, client, user_token=user, worker_token=worker, name="moved")
    _status(client, preempted, "preempted", exit_code=0)

    got = receiver.wait_for("/ann", 5)
    events = [_verified(every["secret"], r) for r in got]
    by_event = {e["event"]: e for e in events}
    assert sorted(by_event) == sorted(
        ["job.started", "job.succeeded", "job.failed", "job.cancelled", "job.preempted"]
    )
    assert [e["event"] for e in events if e["job"]["id"] == done.job_id] == ["job.started", "job.succeeded"]
    assert by_event["job.started"]["job"]["status"] == "running"
    assert by_event["job.succeeded"]["job"]["status"] == "succeeded"
    assert by_event["job.failed"]["job"]["id"] == failed.job_id
    assert by_event["job.failed"]["job"]["failure"]["code"] == "TrainingDivergedError"
    assert by_event["job.cancelled"]["job"]["id"] == cancelled.job_id
    assert by_event["job.preempted"]["job"]["id"] == preempted.job_id
    assert by_event["job.preempted"]["job"]["status"] == "queued"
    assert all(set(e) == {"event", "job", "at"} for e in events)
    assert {r.headers["X-Torchyard-Event"] for r in got} == set(by_event)
    # The failures-only subscription got the failure alone, signed with its own secret.
    (only,) = receiver.wait_for("/ann-failures", 1)
    assert _verified(failures["secret"], only)["event"] == "job.failed"
    with pytest.raises(WebhookVerificationError):
        _verified(every["secret"], only)
    # Another user's jobs are not told to ann's subscriptions, nor ann's to bob's.
    assert receiver.at("/bob") == []

    logged = _wait_deliveries(
        client, user, every["id"], lambda items: all(d["status"] == "delivered" for d in items)
    )
    assert len(logged) == 5
    assert [d["event"] for d in logged][-2:] == ["job.succeeded", "job.started"]  # newest first
    for d in logged:
        assert (d["status"], d["attempts"], d["last_status"]) == ("delivered", 1, 200), d
        assert d["last_response"] == "answered 200" and d["next_attempt_at"] is None
        assert d["finished_at"] is not None
    assert {r.headers["X-Torchyard-Delivery"] for r in got} == {d["id"] for d in logged}
    page = client.get(
        f"/v1/webhooks/{every['id']}/deliveries", params={"limit": 2}, headers=auth(user)
    ).json()
    rest = client.get(
        f"/v1/webhooks/{every['id']}/deliveries", params={"cursor": page["next_cursor"]}, headers=auth(user)
    ).json()
    assert [d["id"] for d in page["items"] + rest["items"]] == [d["id"] for d in logged]


@pytest.mark.both_databases
def test_a_failing_receiver_is_retried_with_backoff_until_it_answers(
    client: TestClient, settings: Settings, receiver: Receiver
) -> None:
    user = create_token(client, "user", "cat")
    receiver.answers["/flaky"] = [500, 500]
    receiver.answers["/down"] = [503] * 100
    flaky = _subscribe(client, user, receiver.url("/flaky"), ["job.failed"])
    down = _subscribe(client, user, receiver.url("/down"), ["job.failed"])
    job = start_running_job(settings, client, user_token=user)
    _status(client, job, "failed", exit_code=1, failure={"code": "TrainingDivergedError", "message": "nan"})

    tries = receiver.wait_for("/flaky", 3)
    assert len({r.headers["X-Torchyard-Delivery"] for r in tries}) == 1  # one delivery, tried 3 times
    assert len({r.body for r in tries}) == 1
    for r in tries:
        assert _verified(flaky["secret"], r)["job"]["id"] == job.job_id
    (delivered,) = _wait_deliveries(client, user, flaky["id"], lambda items: items[0]["status"] != "pending")
    assert (delivered["status"], delivered["attempts"], delivered["last_status"]) == ("delivered", 3, 200)

    # A receiver that never answers 2xx: tried with growing waits, then given up, its answer kept.
    (gave_up,) = _wait_deliveries(client, user, down["id"], lambda items: items[0]["status"] != "pending")
    assert gave_up["status"] == "failed" and gave_up["last_status"] == 503, gave_up
    assert gave_up["last_response"] == "answered 503" and gave_up["next_attempt_at"] is None
    stamps = [float(r.headers["X-Torchyard-Timestamp"]) for r in receiver.at("/down")]
    assert 3 <= gave_up["attempts"] == len(stamps) <= 6


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_replicas_claim_different_deliveries(settings: Settings) -> None:
    """A delivery another replica holds (its row locked while it claims) is skipped, not
    waited for; one claimed is not claimed again until its send's time is past. (No app
    here: its own delivery loop would claim them too.)"""
    upgrade(settings.sqlalchemy_url)
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            token, _ = create_token_row(session, "fay", Role.USER)
            fay = Principal(id=token.id, name=token.name, role=Role.USER)
        with db.session() as session:
            hook = webhooks.create_webhook(session, settings, fay, "http://127.0.0.1:9/never", ["job.failed"])
        with db.transaction() as session:
            made = [
                webhooks.emit(session, fay.id, "job.failed", "job", lambda: {"id": "j"}) for _ in range(3)
            ]
        assert made == [1, 1, 1]
        with db.read_session() as session:
            rows = list(session.scalars(select(WebhookDelivery).where(WebhookDelivery.webhook_id == hook.id)))
        with db.transaction() as other:  # another replica, in the middle of its claim
            other.execute(
                select(WebhookDelivery).where(WebhookDelivery.id == rows[0].id).with_for_update()
            ).all()
            claimed = webhook_delivery.claim_due(db, settings)
            assert sorted(d.id for d in claimed) == sorted(r.id for r in rows[1:])
            assert {d.secret for d in claimed} == {hook.secret}
        assert [d.id for d in webhook_delivery.claim_due(db, settings)] == [rows[0].id]
        assert webhook_delivery.claim_due(db, settings) == []
    finally:
        db.dispose()


def test_verify_refuses_forgeries_and_replays() -> None:
    secret, body = "s3cret", b'{"at":"2026-12-01T10:00:00+00:00","event":"job.failed","job":{"id":"j"}}'
    now = 1_800_000_000
    signature = sign(secret, now, body)
    assert signature.startswith("sha256=") and len(signature) == 7 + 64
    assert verify(secret, str(now), body, signature, now=now + 299)["event"] == "job.failed"
    with pytest.raises(WebhookVerificationError, match="replayed"):
        verify(secret, str(now), body, signature, now=now + 301)  # recorded and sent again later
    with pytest.raises(WebhookVerificationError, match="replayed"):
        verify(secret, str(now), body, signature, tolerance_s=60, now=now + 61)
    forged = [
        ("other", str(now), body, signature),  # another secret
        (secret, str(now), body.replace(b"failed", b"succeeded"), signature),  # another body
        (secret, str(now + 1), body, signature),  # another timestamp
        (secret, str(now), body, signature.upper()),
        (secret, str(now), body, ""),
    ]
    for args in forged:
        with pytest.raises(WebhookVerificationError, match="signature"):
            verify(*args, now=now)
    with pytest.raises(WebhookVerificationError, match="unix seconds"):
        verify(secret, "yesterday", body, signature, now=now)


def test_subscriptions_are_validated_private_and_their_secrets_encrypted(
    client: TestClient, settings: Settings
) -> None:
    ann, bob = create_token(client, "user", "ann"), create_token(client, "user", "bob")
    bad = [
        ({"url": "ftp://example.com/hook", "events": ["job.failed"]}, "url", "http"),
        ({"url": "http:///nohost", "events": ["job.failed"]}, "url", "host"),
        ({"url": "https://example.com/" + "a" * 2000, "events": ["job.failed"]}, "url", "2000"),
        ({"url": "https://example.com:port/", "events": ["job.failed"]}, "url", "port"),
        ({"url": "https://example.com/", "events": []}, "events", "job.started, job.succeeded"),
        (
            {"url": "https://example.com/", "events": ["job.done"]},
            "events",
            "sweep.best_changed, sweep.ended",
        ),
        ({"url": "https://example.com/", "events": ["job.failed"], "secret": "x"}, "secret", "unknown"),
        ({"url": "https://example.com/"}, "events", ""),
    ]
    for body, where, said in bad:
        r = client.post("/v1/webhooks", json=body, headers=auth(ann))
        assert r.status_code == 422, (body, r.text)
        answer = r.json()
        fields = [e["field"] for e in answer.get("errors", [])] or [answer["details"]["field"]]
        assert where in fields, r.text
        assert said in answer["message"] or any(said in e["message"] for e in answer.get("errors", [])), (
            r.text
        )

    hook = _subscribe(client, ann, "https://example.com/hook", ["job.failed", "job.failed", "sweep.ended"])
    assert hook["events"] == ["job.failed", "sweep.ended"] and hook["team"] is None
    listed = client.get("/v1/webhooks", headers=auth(ann)).json()["items"]
    assert [h["id"] for h in listed] == [hook["id"]]
    assert "secret" not in listed[0] and hook["secret"] not in json.dumps(listed)
    assert client.get("/v1/webhooks", headers=auth(bob)).json()["items"] == []

    # Stored encrypted under the data directory's key (0600), which decrypts it.
    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as session:
            stored = session.scalars(select(Webhook.secret_encrypted).where(Webhook.id == hook["id"])).one()
    finally:
        db.dispose()
    assert hook["secret"] not in stored
    key = key_path(settings)
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert Fernet(key.read_bytes().strip()).decrypt(stored.encode()).decode() == hook["secret"]

    # Another user's subscription is not found, for them as any missing one.
    for method, path in (
        ("DELETE", f"/v1/webhooks/{hook['id']}"),
        ("GET", f"/v1/webhooks/{hook['id']}/deliveries"),
    ):
        assert client.request(method, path, headers=auth(bob)).status_code == 404
        assert client.request(method, path.replace(hook["id"], "nope"), headers=auth(ann)).status_code == 404
    assert client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth(ann)).json()["items"] == []

    # At most MAX_WEBHOOKS_PER_USER each.
    for n in range(MAX_WEBHOOKS_PER_USER - 1):
        _subscribe(client, ann, f"https://example.com/{n}", ["job.started"])
    r = client.post(
        "/v1/webhooks", json={"url": "https://example.com/x", "events": ["job.failed"]}, headers=auth(ann)
    )
    assert r.status_code == 409 and str(MAX_WEBHOOKS_PER_USER) in r.json()["message"], r.text
    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=auth(ann)).json()["id"] == hook["id"]
    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=auth(ann)).status_code == 404
    assert len(client.get("/v1/webhooks", headers=auth(ann)).json()["items"]) == MAX_WEBHOOKS_PER_USER - 1


def test_sweep_best_changed_and_ended(client: TestClient, settings: Settings, receiver: Receiver) -> None:
    user = create_token(client, "user", "dan")
    worker = create_token(client, "worker")
    register_node(client, worker, "n1", units=2)
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:  # seen, so trials are accepted; not ready, so none is placed
            session.execute(update(Node).values(status="lost"))
        dataset = insert_dataset(settings, token_id(client, user))
        hook = _subscribe(client, user, receiver.url("/dan"), ["sweep.best_changed", "sweep.ended"])
        body = {
            "name": "lr",
            "job": {
                "model": {"architecture": "resnet18"},
                "train_dataset": dataset,
                "validation_dataset": dataset,
            },
            "search_space": {"parameters.learning_rate": {"type": "float", "low": 0.001, "high": 0.5}},
            "objective": {"metric": "val.top1", "goal": "maximize"},
            "algorithm": "random",
            "max_trials": 2,
            "max_concurrent_trials": 1,
        }
        r = client.post("/v1/sweeps", json=body, headers=auth(user))
        assert r.status_code == 201, r.text
        sweep_id = r.json()["id"]
        with db.transaction() as session:
            (trial,) = session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id)).all()
            _succeed(session, trial.job_id, 0.8)
        with db.transaction() as session:
            sweep_rounds.drive_sweep(session, settings, sweep_id)
        assert client.post(f"/v1/sweeps/{sweep_id}/cancel", headers=auth(user)).status_code == 200
        with db.read_session() as session:
            assert session.get_one(Sweep, sweep_id).status == "cancelled"
    finally:
        db.dispose()
    # Deliveries due together go out concurrently: their order of arrival is not theirs of emission.
    got = sorted(
        (_verified(hook["secret"], r) for r in receiver.wait_for("/dan", 2)), key=lambda e: e["event"]
    )
    assert [e["event"] for e in got] == ["sweep.best_changed", "sweep.ended"]
    assert got[0]["sweep"]["best_trial"]["value"] == 0.8 and got[0]["sweep"]["id"] == sweep_id
    assert got[1]["sweep"]["status"] == "cancelled"


def _succeed(session: Any, job_id: str, value: float) -> None:
    """What a trial's worker reports leave: one epoch's objective, the job succeeded."""
    now = utcnow()
    job = session.get_one(Job, job_id)
    attempt = Attempt(
        job_id=job_id, number=1, status="succeeded", master_addr="x", master_port=1, finished_at=now
    )
    session.add(attempt)
    session.flush()
    session.add(
        Metric(
            job_id=job_id,
            attempt_id=attempt.id,
            attempt=1,
            name="val.top1",
            value=value,
            epoch=1,
            step=10,
            rank=0,
            time=now,
        )
    )
    job.status, job.started_at, job.scheduled_at, job.finished_at = "succeeded", now, now, now
    job.attempts_count, job.model_sha256 = 1, "0" * 64


def _team_member(client: TestClient, name: str, teams: list[str]) -> str:
    """A user of ``teams`` (the first their default) and a token of theirs."""
    assert client.post("/v1/users", json={"name": name, "teams": teams}).status_code == 201
    r = client.post("/v1/tokens", json={"name": f"{name}-laptop", "role": "user", "user": name})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


def test_a_teams_subscription_gets_every_job_of_the_team_and_its_members_see_it(
    client: TestClient, settings: Settings, receiver: Receiver
) -> None:
    for team in ("vision", "speech"):
        assert client.post("/v1/teams", json={"name": team, "quotas": [{"nominal": 8}]}).status_code == 201
    ann, bob = _team_member(client, "ann", ["vision"]), _team_member(client, "bob", ["vision"])
    cy = _team_member(client, "cy", ["speech"])
    worker = create_token(client, "worker")

    # Only a member (or an admin) subscribes a team; default shares nothing.
    refused = [
        (cy, "vision", 422, "your teams are speech"),
        (ann, "default", 422, "shares nothing"),
        (ann, "nope", 422, "you are not in team 'nope'"),
        (None, "nope", 404, "team 'nope' not found"),  # the admin
    ]
    for token, team, status, said in refused:
        body = {"url": receiver.url("/x"), "events": ["job.failed"], "team": team}
        r = client.post("/v1/webhooks", json=body, headers=auth(token) if token else {})
        assert r.status_code == status and said in r.json()["message"], r.text
    team_hook = client.post(
        "/v1/webhooks",
        json={"url": receiver.url("/vision"), "events": ["job.failed"], "team": "vision"},
        headers=auth(ann),
    ).json()
    assert team_hook["team"] == "vision" and team_hook["secret"]
    own = _subscribe(client, ann, receiver.url("/ann"), ["job.failed"])
    r = client.post(
        "/v1/webhooks", json={"url": receiver.url("/speech"), "events": ["job.failed"], "team": "speech"}
    )
    assert r.status_code == 201 and r.json()["team"] == "speech", r.text  # an admin, of any team
    speech_hook = r.json()

    # A member lists their own and their teams' subscriptions; another team's members see none.
    def listed(token: str) -> list[tuple[str, str | None]]:
        items = client.get("/v1/webhooks", headers=auth(token)).json()["items"]
        return [(h["id"], h["team"]) for h in items]

    assert listed(ann) == [(team_hook["id"], "vision"), (own["id"], None)]
    assert listed(bob) == [(team_hook["id"], "vision")]
    assert listed(cy) == [(speech_hook["id"], "speech")]

    # bob's job and ann's own fail (team vision), and cy's (speech).
    failure = {"code": "TrainingDivergedError", "message": "nan"}
    jobs = {}
    for who, token in (("bob", bob), ("ann", ann), ("cy", cy)):
        team = "speech" if who == "cy" else "vision"  # their own, as a submission makes it
        job = start_running_job(settings, client, user_token=token, worker_token=worker, name=who, team=team)
        assert client.get(f"/v1/jobs/{job.job_id}", headers=auth(token)).json()["team"] == team
        _status(client, job, "failed", exit_code=1, failure=failure)
        jobs[who] = job.job_id
    # The team's subscription: one delivery per job of the team, whoever submitted it (ann's own
    # job once, though it is her subscription too); ann's own: her job alone.
    got = [_verified(team_hook["secret"], r)["job"]["id"] for r in receiver.wait_for("/vision", 2)]
    assert sorted(got) == sorted([jobs["bob"], jobs["ann"]])
    assert [_verified(own["secret"], r)["job"]["id"] for r in receiver.wait_for("/ann", 1)] == [jobs["ann"]]
    assert [_verified(speech_hook["secret"], r)["job"]["id"] for r in receiver.wait_for("/speech", 1)] == [
        jobs["cy"]
    ]
    # The outbox rows are written with the change: no more than those were recorded.
    assert len(_deliveries(client, bob, team_hook["id"])) == 2
    assert len(_deliveries(client, ann, own["id"])) == 1
    assert len(_deliveries(client, cy, speech_hook["id"])) == 1

    # A member reads the team's deliveries but deletes only what they made; others: not found.
    assert client.get(f"/v1/webhooks/{own['id']}/deliveries", headers=auth(bob)).status_code == 404
    r = client.delete(f"/v1/webhooks/{team_hook['id']}", headers=auth(bob))
    assert r.status_code == 403 and "only they or an admin" in r.json()["message"], r.text
    assert client.delete(f"/v1/webhooks/{team_hook['id']}", headers=auth(cy)).status_code == 404
    assert client.delete(f"/v1/webhooks/{speech_hook['id']}", headers=auth(cy)).status_code == 403
    assert client.delete(f"/v1/webhooks/{team_hook['id']}", headers=auth(ann)).status_code == 200
    assert client.delete(f"/v1/webhooks/{speech_hook['id']}").status_code == 200  # the admin
    assert listed(bob) == [] and listed(ann) == [(own["id"], None)]
