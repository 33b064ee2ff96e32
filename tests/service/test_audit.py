"""The audit trail (docs/audit.md): every user or admin write recorded with who, when, from
where, what and the status answered (refusals too), the worker protocol not; GET /v1/audit's
filters and pages, the JSON lines export, admins only; no secret in any event; every writing
route mapped; and nothing ever updates or deletes an event.

One app for the module (in-process), its database a copy of the migrated template; each test
makes its own rows and looks its events up by their targets."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.engine import Engine

from service.api.app import create_app
from service.api.audit_trail import AUDITED, NOT_AUDITED, WORKER_PREFIX, WRITE_METHODS
from service.config import Settings
from tests.support.factories import auth, insert_dataset, job_spec
from torchyard.contract.headers import AGENT_KEY_HEADER

SERVICE_DIR = Path(__file__).resolve().parents[2] / "service"
AGENT_KEY = "k" * 32
NODE = {"name": "audit-n1", "address": "127.0.0.1", "units": 1, "accelerator": "cpu", "agent_key": AGENT_KEY}
_WRITES_TO_TRAIL = re.compile(r"^\s*(UPDATE|DELETE\s+FROM)\s+\"?audit_events\b", re.IGNORECASE)


class Trail:
    """The module's app, its admin token, and every SQL statement run against the trail."""

    def __init__(self, app: FastAPI, settings: Settings) -> None:
        self.app = app
        self.client = TestClient(app)
        self.settings = settings
        self.admin = ""
        self.worker = self.worker_id = ""
        self.inserts = 0
        self.rewrites: list[str] = []

    def events(self, **filters: Any) -> list[dict[str, Any]]:
        r = self.client.get("/v1/audit", params={"limit": 500, **filters}, headers=auth(self.admin))
        assert r.status_code == 200, r.text
        items: list[dict[str, Any]] = r.json()["items"]
        return items

    def token(self, name: str, role: str = "user") -> tuple[str, str]:
        r = self.client.post("/v1/tokens", json={"name": name, "role": role}, headers=auth(self.admin))
        assert r.status_code == 201, r.text
        return r.json()["token"], r.json()["id"]


@pytest.fixture(scope="module")
def trail(tmp_path_factory: pytest.TempPathFactory, sqlite_template: Path) -> Iterator[Trail]:
    root = tmp_path_factory.mktemp("audit")
    shutil.copyfile(sqlite_template, root / "torchyard.db")
    settings = Settings(data_dir=root / "data", database_url=f"sqlite:///{root / 'torchyard.db'}")
    app = create_app(settings)
    found = Trail(app, settings)

    def watch(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if _WRITES_TO_TRAIL.match(statement):
            found.rewrites.append(statement)
        elif re.match(r"^\s*INSERT\s+INTO\s+\"?audit_events\b", statement, re.IGNORECASE):
            found.inserts += 1

    event.listen(Engine, "before_cursor_execute", watch)
    try:
        with TestClient(app) as client:
            found.client = client
            found.admin = settings.admin_token_path.read_text().strip()
            # A node, so that jobs can be submitted (the worker protocol's: not recorded).
            found.worker, found.worker_id = found.token("node-agent", role="worker")
            r = client.post("/v1/worker/nodes", json=NODE, headers=auth(found.worker))
            assert r.status_code == 200, r.text
            yield found
    finally:
        event.remove(Engine, "before_cursor_execute", watch)


def _one(events: list[dict[str, Any]], action: str) -> dict[str, Any]:
    matching = [e for e in events if e["action"] == action]
    assert len(matching) == 1, (action, events)
    return matching[0]


def test_a_job_submitted_cancelled_and_deleted_is_three_events_with_who_and_from_where(trail: Trail) -> None:
    token, token_id = trail.token("alice")
    dataset = insert_dataset(trail.settings, token_id, name="digits")
    c = trail.client
    r = c.post("/v1/jobs", json=job_spec(dataset, dataset, name="audited", priority=3), headers=auth(token))
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    cancelled = c.post(f"/v1/jobs/{job}/cancel", headers=auth(token))
    assert cancelled.status_code == 200, cancelled.text
    # 200, or 409 when a scheduling pass had placed the job on the node before the cancel
    # (it is then cancelling until its agent stops it): the trail has the status either way.
    deleted = c.delete(f"/v1/jobs/{job}", headers=auth(token))
    assert deleted.status_code in (200, 409), deleted.text

    events = trail.events(target=job)
    assert [e["action"] for e in events] == ["job.delete", "job.cancel", "job.submit"]  # newest first
    submit = _one(events, "job.submit")
    assert submit["actor"] == {"name": "alice", "token_id": token_id, "token_name": "alice", "role": "user"}
    assert submit["via"] == "token"
    assert submit["source"] == "testclient"
    assert submit["target"] == {"kind": "job", "id": job}
    assert submit["outcome"] == 201
    assert submit["details"]["name"] == "audited"
    assert submit["details"]["priority"] == 3
    assert submit["details"]["train_dataset"] == dataset
    assert [e["outcome"] for e in events] == [deleted.status_code, 200, 201]
    # The kind filter spelling: kind:id.
    assert [e["action"] for e in trail.events(target=f"job:{job}")] == [e["action"] for e in events]


def test_tokens_created_and_revoked_are_recorded_without_their_values(trail: Trail) -> None:
    token, token_id = trail.token("bob-ci")
    r = trail.client.delete(f"/v1/tokens/{token_id}", headers=auth(trail.admin))
    assert r.status_code == 200, r.text

    events = trail.events(target=token_id)
    created = _one(events, "token.create")
    assert created["details"] == {"name": "bob-ci", "role": "user"}
    assert created["actor"]["role"] == "admin"
    assert created["actor"]["name"] == "admin"
    revoked = _one(events, "token.revoke")
    assert revoked["outcome"] == 200
    assert revoked["target"] == {"kind": "token", "id": token_id}
    export = trail.client.get("/v1/audit/export", headers=auth(trail.admin)).text
    assert token not in export


def test_a_team_created_and_its_quota_changed(trail: Trail) -> None:
    c = trail.client
    body = {"name": "vision", "quotas": [{"pool": "default", "nominal": 4}]}
    assert c.post("/v1/teams", json=body, headers=auth(trail.admin)).status_code == 201
    change = {"quotas": [{"pool": "default", "nominal": 8, "borrowing_limit": 2}], "weight": 2}
    r = c.patch("/v1/teams/vision", json=change, headers=auth(trail.admin))
    assert r.status_code == 200, r.text

    events = trail.events(target="team:vision")
    assert _one(events, "team.create")["details"]["quotas"] == [{"pool": "default", "nominal": 4}]
    update = _one(events, "team.update")
    assert update["target"] == {"kind": "team", "id": "vision"}
    assert update["details"] == change


def test_a_refused_request_is_recorded_with_its_status(trail: Trail) -> None:
    token, token_id = trail.token("carol")
    r = trail.client.post("/v1/jobs", json={"model": 5}, headers=auth(token))
    assert r.status_code == 422
    refused = _one(trail.events(actor=token_id, action="job."), "job.submit")
    assert refused["outcome"] == 422
    assert refused["target"] == {"kind": "job", "id": None}
    # A bad token: recorded with nobody as the actor.
    r = trail.client.post("/v1/jobs/nope/cancel", headers=auth("ty_not-a-token"))
    assert r.status_code == 401
    denied = _one(trail.events(target="nope"), "job.cancel")
    assert denied["outcome"] == 401
    assert denied["via"] == "none"
    assert denied["actor"] == {"name": None, "token_id": None, "token_name": None, "role": None}


def test_web_sign_in_success_and_failure(trail: Trail) -> None:
    token, token_id = trail.token("dave")
    browser = TestClient(trail.app)  # no Authorization header: the sign-in form's request
    assert browser.post("/v1/session", json={"token": token}).status_code == 200
    assert browser.post("/v1/session", json={"token": "ty_wrong-guess"}).status_code == 401

    signed_in = _one(trail.events(actor="dave", action="auth."), "auth.sign_in")
    assert signed_in["outcome"] == 200
    assert signed_in["via"] == "session"
    assert signed_in["target"] == {"kind": "token", "id": token_id}
    assert signed_in["details"] == {}
    failures = [e for e in trail.events(action="auth.sign_in") if e["outcome"] == 401]
    assert failures and failures[0]["actor"]["token_id"] is None
    export = trail.client.get("/v1/audit/export", headers=auth(trail.admin)).text
    assert token not in export and "ty_wrong-guess" not in export


def test_a_webhook_is_recorded_without_its_secret(trail: Trail) -> None:
    token, _ = trail.token("erin")
    body = {"url": "http://127.0.0.1:9/hook", "events": ["job.succeeded"]}
    r = trail.client.post("/v1/webhooks", json=body, headers=auth(token))
    assert r.status_code == 201, r.text
    created = _one(trail.events(target=r.json()["id"]), "webhook.create")
    assert created["details"] == body
    export = trail.client.get("/v1/audit/export", headers=auth(trail.admin)).text
    assert r.json()["secret"] not in export


def test_worker_heartbeats_are_not_recorded(trail: Trail) -> None:
    c = trail.client
    r = c.post(
        "/v1/worker/nodes/audit-n1/heartbeat",
        json={"leases": []},
        headers={**auth(trail.worker), AGENT_KEY_HEADER: AGENT_KEY},
    )
    assert r.status_code == 200, r.text
    assert c.post("/v1/worker/nodes", json=NODE, headers=auth(trail.worker)).status_code == 200
    assert [e["action"] for e in trail.events(actor=trail.worker_id)] == []
    assert trail.events(target="audit-n1") == []


def test_filters_and_pages_newest_first(trail: Trail) -> None:
    token, token_id = trail.token("frank")
    c = trail.client
    for n in range(5):
        assert c.patch("/v1/teams/nope", json={"weight": n + 1}, headers=auth(token)).status_code == 403
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"actor": "frank", "action": "team.", "limit": 2}
        if cursor:
            params["cursor"] = cursor
        r = c.get("/v1/audit", params=params, headers=auth(trail.admin))
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["items"]) <= 2
        seen += [e["id"] for e in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == 5 and seen == sorted(seen, reverse=True)
    every = trail.events(actor=token_id)
    assert [e["details"]["weight"] for e in every] == [5, 4, 3, 2, 1]
    assert {e["outcome"] for e in every} == {403}
    # since/until by time; a time without a zone is a 422.
    newest = every[0]["at"]
    assert [e["id"] for e in trail.events(actor="frank", since=newest)] == [seen[0]]
    assert [e["id"] for e in trail.events(actor="frank", until=newest)] == seen[1:]
    r = c.get("/v1/audit", params={"since": "2026-01-01T00:00:00"}, headers=auth(trail.admin))
    assert r.status_code == 422
    assert c.get("/v1/audit", params={"cursor": "bogus"}, headers=auth(trail.admin)).status_code == 422


def test_export_is_json_lines_oldest_first(trail: Trail) -> None:
    token, token_id = trail.token("grace")
    for n in range(3):
        trail.client.patch("/v1/users/nobody", json={"admin": bool(n)}, headers=auth(token))
    r = trail.client.get("/v1/audit/export", params={"actor": token_id}, headers=auth(trail.admin))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert [e["action"] for e in lines] == ["user.update"] * 3
    assert [e["details"]["admin"] for e in lines] == [False, True, True]
    assert [e["id"] for e in lines] == sorted(e["id"] for e in lines)
    everything = trail.client.get("/v1/audit/export", headers=auth(trail.admin)).text.splitlines()
    assert len(everything) == trail.inserts  # every event written, none left out


def test_only_admins_read_the_trail(trail: Trail) -> None:
    token, _ = trail.token("heidi")
    for path in ("/v1/audit", "/v1/audit/export"):
        r = trail.client.get(path, headers=auth(token))
        assert r.status_code == 403, path
        assert trail.client.get(path).status_code == 401


def test_a_trusted_proxy_forwards_the_client_address(trail: Trail) -> None:
    token, _ = trail.token("ivan")
    forwarded = {**auth(token), "X-Forwarded-For": "203.0.113.7"}
    # The peer is loopback (TORCHYARD_TRUSTED_PROXIES' default): its header is believed.
    proxied = TestClient(trail.app, client=("127.0.0.1", 40000))
    proxied.post("/v1/jobs/through-proxy/cancel", headers=forwarded)
    # Any other peer's header is not.
    trail.client.post("/v1/jobs/not-through-proxy/cancel", headers=forwarded)
    assert [e["source"] for e in trail.events(target="through-proxy")] == ["203.0.113.7"]
    assert [e["source"] for e in trail.events(target="not-through-proxy")] == ["testclient"]


def _api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _api_routes(included.routes)


def test_every_writing_route_of_users_and_admins_is_mapped(trail: Trail) -> None:
    writes = {
        (method, route.path)
        for route in _api_routes(trail.app.routes)
        for method in route.methods & WRITE_METHODS
        if not route.path.startswith(WORKER_PREFIX)
    }
    assert writes, "no writing route found"
    unmapped = sorted(w for w in writes if w not in AUDITED and w not in NOT_AUDITED)
    assert unmapped == [], f"add these routes to service/api/audit_trail.py's AUDITED: {unmapped}"
    assert ("POST", "/v1/jobs") in writes and ("DELETE", "/v1/models/{name}/versions/{version}") in writes
    issue_actions = {
        "auth.sign_in",
        "token.create",
        "token.revoke",
        "job.submit",
        "job.cancel",
        "job.delete",
        "sweep.create",
        "model.register",
        "model.delete",
        "dataset.delete",
        "team.create",
        "team.update",
        "user.create",
        "user.update",
    }
    assert issue_actions <= {entry.action for key, entry in AUDITED.items() if key in writes}


def test_nothing_updates_or_deletes_the_trail(trail: Trail) -> None:
    """Last in the module: every statement the tests above ran against the trail was an INSERT."""
    assert trail.inserts > 20
    assert trail.rewrites == []
    # Nor does the service's code say so anywhere.
    for path in SERVICE_DIR.rglob("*.py"):
        text = path.read_text()
        for pattern in (
            r"update\(\s*AuditEvent",
            r"delete\(\s*AuditEvent",
            r"(UPDATE|DELETE FROM)\s+audit_events",
        ):
            assert not re.search(pattern, text, re.IGNORECASE), (path, pattern)
