"""Ownership by user and team read access (docs/teams.md; docs/api.md, Who sees what): every
token of a user owns what any of them made; a teammate reads a job (gets it, lists it,
streams it, clones it) but may not change it (403); another team's job is a 404; a token
made without a user owns only its own, as before teams; the team ``default`` shares nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from service.config import Settings
from service.db.engine import Database
from service.db.models import Dataset, Team
from tests.support.dataset_files import small_tree, tar_tree
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id


def _ok(r: Any, code: int = 200) -> Any:
    assert r.status_code == code, r.text
    return r.json()


def _user_token(client: TestClient, name: str, user: str) -> str:
    body = _ok(client.post("/v1/tokens", json={"name": name, "role": "user", "user": user}), 201)
    token: str = body["token"]
    return token


def _listed(client: TestClient, token: str, **params: Any) -> dict[str, str | None]:
    """The jobs the token lists (every page), id -> team."""
    out: dict[str, str | None] = {}
    cursor = None
    while True:
        page = _ok(
            client.get("/v1/jobs", params={**params, "limit": 2, "cursor": cursor}, headers=auth(token))
        )
        out.update({j["id"]: j["team"] for j in page["items"]})
        cursor = page["next_cursor"]
        if cursor is None:
            return out


def _events(client: TestClient, token: str, job_id: str) -> list[dict[str, Any]]:
    """The events stream of a finished job: it sends the final status and ends."""
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=auth(token)) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    return [json.loads(line[5:]) for line in lines]


@pytest.mark.both_databases  # the lists' IN and OR, on both
def test_tokens_of_a_user_share_and_teammates_read_only(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    for team in ("vision", "speech"):
        _ok(client.post("/v1/teams", json={"name": team}), 201)
    for user, teams in (("alice", ["vision"]), ("bob", ["vision"]), ("carol", ["speech"])):
        _ok(client.post("/v1/users", json={"name": user, "teams": teams}), 201)
    desk, laptop = _user_token(client, "desk", "alice"), _user_token(client, "laptop", "alice")
    bob, carol = _user_token(client, "bob-1", "bob"), _user_token(client, "carol-1", "carol")
    register_node(client, create_token(client, "worker"), "node-a", units=4)
    # Another user's job holds the whole node: alice's job waits, queued, and is cancelled at once.
    other = create_token(client, "user", "other")
    theirs = insert_dataset(settings, token_id(client, other))
    filler = job_spec(theirs, theirs, name="filler", resources={"node_count": 1, "process_count_per_node": 4})
    _ok(client.post("/v1/jobs", json=filler, headers=auth(other)), 201)

    # A dataset uploaded with one of alice's tokens is hers with the other: used, listed, got.
    archive = tar_tree(small_tree(tmp_path / "pets"), tmp_path / "pets.tar")
    with archive.open("rb") as f:
        data = _ok(
            client.post(
                "/v1/datasets", data={"name": "pets"}, files={"file": ("pets.tar", f)}, headers=auth(desk)
            ),
            201,
        )["id"]
    assert data in [d["id"] for d in _ok(client.get("/v1/datasets", headers=auth(laptop)))["items"]]
    _ok(client.get("/v1/datasets/pets", headers=auth(laptop)))
    # ... and not her teammate's: datasets are not shared with the team.
    assert _ok(client.get("/v1/datasets", headers=auth(bob)))["items"] == []
    assert client.get(f"/v1/datasets/{data}", headers=auth(bob)).status_code == 404
    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as s:
            vision = s.scalars(select(Team.id).where(Team.name == "vision")).one()
            assert s.get_one(Dataset, data).team_id == vision
    finally:
        db.dispose()

    submitted = _ok(
        client.post("/v1/jobs", json=job_spec("pets", "pets", name="cats"), headers=auth(laptop)), 201
    )
    job = submitted["id"]
    assert submitted["team"] == "vision" and submitted["owner"] == token_id(client, laptop)
    # The other token of the user owns it: reads and changes it.
    assert _ok(client.get(f"/v1/jobs/{job}", headers=auth(desk)))["team"] == "vision"
    patched = _ok(client.patch(f"/v1/jobs/{job}", json={"tags": ["mine"]}, headers=auth(desk)))
    assert patched["tags"] == ["mine"]
    assert _listed(client, desk) == {job: "vision"}

    # A teammate reads it: by id and by name, in the list (with ?team=), its metrics and logs.
    assert _ok(client.get("/v1/jobs/cats", headers=auth(bob)))["id"] == job
    assert _listed(client, bob) == {job: "vision"}
    assert _listed(client, bob, team="vision") == {job: "vision"}
    _ok(client.get(f"/v1/jobs/{job}/metrics", headers=auth(bob)))
    assert client.get(f"/v1/jobs/{job}/logs", headers=auth(bob)).status_code == 200
    # ... but may not change it: 403, and nothing changed.
    for method, path, body in (
        ("POST", f"/v1/jobs/{job}/cancel", None),
        ("PATCH", f"/v1/jobs/{job}", {"tags": ["theirs"]}),
        ("DELETE", f"/v1/jobs/{job}", None),
    ):
        r = client.request(method, path, json=body, headers=auth(bob))
        assert r.status_code == 403 and r.json()["code"] == "PermissionDeniedError", (method, r.text)
    seen = _ok(client.get(f"/v1/jobs/{job}", headers=auth(desk)))
    assert seen["status"] == "queued" and seen["tags"] == ["mine"]
    # A clone is the teammate's own submission, checked as one: the job's datasets are
    # alice's, not shared with the team, so it is refused as if the teammate had named them.
    r = client.post(f"/v1/jobs/{job}/clone", headers=auth(bob))
    assert r.status_code == 404 and r.json()["details"] == {"field": "train_dataset"}, r.text

    # Another team's member: a 404 for everything, nothing listed, and ?team= of a team
    # they are not in is a 404 too.
    for method, path in (
        ("GET", f"/v1/jobs/{job}"),
        ("GET", "/v1/jobs/cats"),
        ("POST", f"/v1/jobs/{job}/cancel"),
    ):
        assert client.request(method, path, headers=auth(carol)).status_code == 404, path
    assert _listed(client, carol) == {}
    r = client.get("/v1/jobs", params={"team": "vision"}, headers=auth(carol))
    assert r.status_code == 404 and r.json()["code"] == "NotFoundError", r.text

    # The owner cancels it; the teammate's stream of it sends its final status.
    assert _ok(client.post(f"/v1/jobs/{job}/cancel", headers=auth(desk)))["status"] == "cancelled"
    events = _events(client, bob, job)
    assert events and events[-1]["status"] == "cancelled"
    with client.stream("GET", f"/v1/jobs/{job}/events", headers=auth(carol)) as r:
        assert r.status_code == 404


def test_tokens_without_a_named_user_own_only_their_own(client: TestClient, settings: Settings) -> None:
    """``POST /v1/tokens`` without ``user``: a user of the token's own in team ``default``,
    which every such user shares, so it shares nothing: each sees only its own."""
    register_node(client, create_token(client, "worker"), "node-a", units=4)
    ann, ben = create_token(client, "user", "ann"), create_token(client, "user", "ben")
    data = insert_dataset(settings, token_id(client, ann))
    job = _ok(client.post("/v1/jobs", json=job_spec(data, data), headers=auth(ann)), 201)
    assert job["team"] == "default"
    assert _listed(client, ann) == {job["id"]: "default"}
    assert _listed(client, ann, team="default") == {job["id"]: "default"}
    assert _listed(client, ben) == {} and _listed(client, ben, team="default") == {}
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth(ben)).status_code == 404
    assert client.get(f"/v1/datasets/{data}", headers=auth(ben)).status_code == 404
    # An admin sees every job, with any team's filter.
    assert _listed(client, create_token(client, "admin", "root")) == {job["id"]: "default"}


def test_a_sweeps_trials_are_its_teams_jobs(client: TestClient, settings: Settings) -> None:
    for team in ("vision", "speech"):
        _ok(client.post("/v1/teams", json={"name": team}), 201)
    _ok(client.post("/v1/users", json={"name": "alice", "teams": ["vision", "speech"]}), 201)
    _ok(client.post("/v1/users", json={"name": "carol", "teams": ["speech"]}), 201)
    alice, carol = _user_token(client, "alice-1", "alice"), _user_token(client, "carol-1", "carol")
    register_node(client, create_token(client, "worker"), "node-a", units=4)
    data = insert_dataset(settings, token_id(client, alice))
    sweep = _ok(
        client.post(
            "/v1/sweeps",
            json={
                "name": "lr",
                "job": job_spec(data, data, team="speech", parameters={"epochs": 1}),
                "search_space": {"parameters.learning_rate": {"type": "float", "low": 0.01, "high": 0.1}},
                "max_trials": 2,
                "max_concurrent_trials": 2,
            },
            headers=auth(alice),
        ),
        201,
    )
    trials = {t["job_id"] for t in sweep["trials"]}
    assert len(trials) == 2
    assert _listed(client, alice, sweep="lr") == dict.fromkeys(trials, "speech")
    # The sweep is alice's; its trials are the team's jobs, read by her teammate.
    assert _listed(client, carol) == dict.fromkeys(trials, "speech")
    assert client.get("/v1/sweeps/lr", headers=auth(carol)).status_code == 404
    # On the cluster view, the teammate sees which jobs hold the node; another user does not.
    outsider = create_token(client, "user", "outsider")
    deadline = time.monotonic() + 20
    while True:
        (node,) = _ok(client.get("/v1/cluster", headers=auth(carol)))["nodes"]
        if len(node["attempts"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert {a["job_id"] for a in node["attempts"]} == trials
    (node,) = _ok(client.get("/v1/cluster", headers=auth(outsider)))["nodes"]
    assert [a["job_id"] for a in node["attempts"]] == [None, None]
