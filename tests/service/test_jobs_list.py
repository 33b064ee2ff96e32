"""``GET /v1/jobs`` filtered by ``tag`` (a job with every tag given) and by ``sweep`` (its
trials), on SQLite and PostgreSQL: the tags are a JSON list, matched in SQL the same way
on both."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id

pytestmark = pytest.mark.both_databases


def _ids(client: TestClient, token: str, **params: object) -> list[str]:
    r = client.get("/v1/jobs", params=params, headers=auth(token))
    assert r.status_code == 200, r.text
    return [j["id"] for j in r.json()["items"]]


def test_jobs_by_tag_and_by_sweep(client: TestClient, settings: Settings) -> None:
    register_node(client, create_token(client, "worker"), "node-a", units=4)
    ann = create_token(client, "user", "ann")
    data = insert_dataset(settings, token_id(client, ann))

    def submit(name: str, tags: list[str]) -> str:
        r = client.post("/v1/jobs", json=job_spec(data, data, name=name), headers=auth(ann))
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        if tags:
            r = client.patch(f"/v1/jobs/{job_id}", json={"tags": tags}, headers=auth(ann))
            assert r.status_code == 200, r.text
        return job_id

    plain = submit("plain", [])
    base = submit("base", ["baseline"])
    # Tags that LIKE, JSON or a prefix could mistake for another: only whole tags match.
    odd = submit("odd", ['a"b', "50%_x", "ünï", "baseline-2"])
    both = submit("both", ["lr", "baseline"])
    sweep = client.post(
        "/v1/sweeps",
        json={
            "name": "lr-search",
            "job": job_spec(data, data, parameters={"epochs": 1}),
            "search_space": {"parameters.learning_rate": {"type": "float", "low": 0.01, "high": 0.1}},
            "max_trials": 2,
            "max_concurrent_trials": 2,
        },
        headers=auth(ann),
    )
    assert sweep.status_code == 201, sweep.text
    trials = sorted(t["job_id"] for t in sweep.json()["trials"])

    assert _ids(client, ann, tag="baseline") == [both, base]
    assert _ids(client, ann, tag=["baseline", "lr"]) == [both]
    assert _ids(client, ann, tag=["lr", "lr"]) == [both]
    assert _ids(client, ann, tag="base") == []
    assert _ids(client, ann, tag='a"b') == [odd]
    assert _ids(client, ann, tag="50%_x") == [odd]
    assert _ids(client, ann, tag="50%") == [] and _ids(client, ann, tag="5_%_x") == []
    assert _ids(client, ann, tag="ünï") == [odd]
    assert len(_ids(client, ann)) == 6 and plain in _ids(client, ann)
    # A sweep by its name or an id prefix; with a tag, what has both.
    assert sorted(_ids(client, ann, sweep="lr-search")) == trials
    assert sorted(_ids(client, ann, sweep=sweep.json()["id"][:6])) == trials
    assert _ids(client, ann, sweep="lr-search", tag="baseline") == []
    # Pages keep the filter.
    first = client.get("/v1/jobs", params={"tag": "baseline", "limit": 1}, headers=auth(ann)).json()
    assert [j["id"] for j in first["items"]] == [both]
    rest = client.get(
        "/v1/jobs", params={"tag": "baseline", "limit": 1, "cursor": first["next_cursor"]}, headers=auth(ann)
    ).json()
    assert [j["id"] for j in rest["items"]] == [base]
    # Another user's sweep is not found; another user sees none of ann's jobs by tag.
    bob = create_token(client, "user", "bob")
    r = client.get("/v1/jobs", params={"sweep": "lr-search"}, headers=auth(bob))
    assert r.status_code == 404 and r.json()["code"] == "NotFoundError", r.text
    assert _ids(client, bob, tag="baseline") == []
    r = client.get("/v1/jobs", params={"tag": [f"t{i}" for i in range(21)]}, headers=auth(ann))
    assert r.status_code == 422, r.text
