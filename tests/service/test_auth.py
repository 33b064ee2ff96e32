"""docs/api.md: tokens, roles and owner scoping."""

from __future__ import annotations

import stat

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from service.config import Settings
from service.db.engine import Database
from service.db.models import Token
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id


def test_admin_token_file_is_private_and_works(client: TestClient, settings: Settings) -> None:
    path = settings.admin_token_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert client.get("/v1/whoami", headers=auth(token)).json()["role"] == "admin"


def test_tokens_are_stored_hashed(client: TestClient, settings: Settings) -> None:
    plain = create_token(client, "user", "alice")
    db = Database(settings.sqlalchemy_url)
    with db.read_session() as s:
        hashes = list(s.scalars(select(Token.token_hash)))
    db.dispose()
    assert plain not in hashes
    assert all(len(h) == 64 for h in hashes)


@pytest.mark.parametrize("header", [None, "Bearer", "Bearer wrong", "Basic abc", "bearer ty_nope"])
def test_missing_or_wrong_token_is_401(client: TestClient, header: str | None) -> None:
    headers = {"Authorization": header} if header is not None else {}
    client.headers.pop("Authorization")
    for method, path in [
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/cluster"),
        ("POST", "/v1/tokens"),
    ]:
        r = client.request(method, path, headers=headers, json={})
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["code"] == "AuthenticationError"
    assert client.get("/healthz").status_code == 200


def test_roles_reach_only_their_routes(client: TestClient) -> None:
    user, worker = create_token(client, "user"), create_token(client, "worker")
    node = {"name": "n1", "address": "10.0.0.1", "units": 2}
    # user → worker route
    r = client.post("/v1/worker/nodes", json=node, headers=auth(user))
    assert r.status_code == 403
    assert r.json()["code"] == "PermissionDeniedError"
    # worker → user routes
    for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/cluster")]:
        r = client.request(method, path, headers=auth(worker), json={})
        assert r.status_code == 403, (method, path)
    # only admins create tokens
    r = client.post("/v1/tokens", json={"name": "x", "role": "admin"}, headers=auth(user))
    assert r.status_code == 403
    assert client.post("/v1/worker/nodes", json=node, headers=auth(worker)).status_code == 200


def test_token_create_validation(client: TestClient) -> None:
    assert client.post("/v1/tokens", json={"name": "x", "role": "root"}).status_code == 422
    assert client.post("/v1/tokens", json={"name": "", "role": "user"}).status_code == 422
    assert client.post("/v1/tokens", json={"name": "x", "role": "user", "admin": True}).status_code == 422


def test_users_see_only_their_own_jobs(client: TestClient, settings: Settings) -> None:
    register_node(client, create_token(client, "worker"), "n1", units=1)
    alice, bob = create_token(client, "user", "alice"), create_token(client, "user", "bob")
    a_id = token_id(client, alice)
    t, v = insert_dataset(settings, a_id), insert_dataset(settings, a_id)
    r = client.post("/v1/jobs", json=job_spec(t, v), headers=auth(alice))
    assert r.status_code == 201
    job = r.json()["id"]
    assert r.json()["owner"] == a_id
    # bob: another user's job is 404 everywhere, and not listed
    assert client.get(f"/v1/jobs/{job}", headers=auth(bob)).status_code == 404
    assert client.post(f"/v1/jobs/{job}/cancel", headers=auth(bob)).status_code == 404
    assert client.get("/v1/jobs", headers=auth(bob)).json()["items"] == []
    # bob cannot submit with alice's datasets
    r = client.post("/v1/jobs", json=job_spec(t, v), headers=auth(bob))
    assert r.status_code == 404
    # alice and the admin see it
    assert client.get(f"/v1/jobs/{job}", headers=auth(alice)).status_code == 200
    assert [j["id"] for j in client.get("/v1/jobs").json()["items"]] == [job]
