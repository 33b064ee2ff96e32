"""The weights store (docs/fine-tuning.md): uploads and their checks, the list, an admin's
delete, the worker's download, and what ``pretrained: true`` needs at submission and claim.

The files here only look like torch archives (the zip magic): the service never loads
them; the node does (tests/worker/trainer/test_pretrained_weights.py)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from fastapi.testclient import TestClient

from service.config import Settings
from tests.support.factories import auth, create_token, insert_dataset, job_spec, token_id
from torchyard.contract.headers import SHA256_HEADER


def _archive(seed: bytes = b"") -> bytes:
    """Bytes that begin as torch.save's zip archive does."""
    return b"PK\x03\x04" + hashlib.sha256(seed).digest() + os.urandom(64)


def _upload(client: TestClient, architecture: str, name: str, body: bytes, token: str | None = None) -> Any:
    headers = auth(token) if token else None
    return client.post(
        "/v1/weights",
        data={"architecture": architecture},
        files={"file": (name, body, "application/octet-stream")},
        headers=headers,
    )


def test_an_upload_is_stored_listed_and_shared(client: TestClient, settings: Settings) -> None:
    user = create_token(client, "user")
    body = _archive(b"a")
    r = _upload(client, "mobilenet_v3_small", "mine.pth", body, token=user)
    assert r.status_code == 201, r.text
    row = r.json()
    sha = hashlib.sha256(body).hexdigest()
    assert (row["architecture"], row["sha256"], row["filename"], row["size_bytes"]) == (
        "mobilenet_v3_small",
        sha,
        "mine.pth",
        len(body),
    )
    assert (settings.data_dir / "weights" / f"{sha}.pth").read_bytes() == body
    # The same file again is the same row; every user sees it.
    again = _upload(client, "mobilenet_v3_small", "copy.pth", body)
    assert again.status_code == 201 and again.json()["id"] == row["id"]
    other = create_token(client, "user", name="other")
    listed = client.get("/v1/weights", headers=auth(other)).json()
    assert [w["id"] for w in listed] == [row["id"]]
    assert client.get("/v1/weights", params={"architecture": "resnet18"}).json() == []
    assert client.get(f"/v1/weights/{row['id']}", headers=auth(other)).json() == row
    # A worker downloads the file with its checksum.
    worker = create_token(client, "worker")
    got = client.get(f"/v1/worker/weights/{row['id']}/file", headers=auth(worker))
    assert got.status_code == 200 and got.content == body
    assert got.headers[SHA256_HEADER] == sha
    # Only an admin deletes.
    assert client.delete(f"/v1/weights/{row['id']}", headers=auth(user)).status_code == 403
    assert client.delete(f"/v1/weights/{row['id']}").status_code == 204
    assert client.get(f"/v1/weights/{row['id']}").status_code == 404
    assert not (settings.data_dir / "weights" / f"{sha}.pth").exists()


def test_a_file_named_with_a_hash_prefix_must_carry_it(client: TestClient) -> None:
    body = _archive(b"b")
    sha = hashlib.sha256(body).hexdigest()
    wrong = _upload(client, "mobilenet_v3_small", "mobilenet_v3_small-deadbeef.pth", body)
    assert wrong.status_code == 422, wrong.text
    message = wrong.json()["message"]
    assert "deadbeef" in message and sha in message
    right = _upload(client, "mobilenet_v3_small", f"mobilenet_v3_small-{sha[:8]}.pth", body)
    assert right.status_code == 201, right.text
    assert client.get("/v1/weights").json()[0]["sha256"] == sha


def test_what_is_not_weights_of_a_known_architecture_is_refused(client: TestClient) -> None:
    r = _upload(client, "mobilenet_v3_small", "x.pth", b"\x80\x02 a pickle, not an archive")
    assert r.status_code == 422 and "not a torch state dict archive" in r.json()["message"], r.text
    r = _upload(client, "resnet5O", "x.pth", _archive())
    assert r.status_code == 422 and r.json()["details"]["field"] == "architecture", r.text
    r = client.post("/v1/weights", files={"file": ("x.pth", _archive(), "application/octet-stream")})
    assert r.status_code == 422 and "architecture" in r.json()["message"], r.text
    assert client.get("/v1/weights").json() == []


def _register(client: TestClient, worker: str, name: str, info: dict[str, Any] | None = None) -> None:
    r = client.post(
        "/v1/worker/nodes",
        json={"name": name, "address": "127.0.0.1", "units": 2, "accelerator": "cpu", "info": info},
        headers=auth(worker),
    )
    assert r.status_code == 200, r.text


def test_pretrained_needs_weights_somewhere(client: TestClient, settings: Settings) -> None:
    worker = create_token(client, "worker")
    _register(client, worker, "node-a")
    me = token_id(client, client.headers["Authorization"].split()[1])
    train, val = insert_dataset(settings, me, name="t"), insert_dataset(settings, me, name="v")
    spec = job_spec(train, val, model={"architecture": "mobilenet_v3_small", "pretrained": True})
    refused = client.post("/v1/jobs", json=spec)
    assert refused.status_code == 422, refused.text
    error = refused.json()
    assert error["details"]["field"] == "model.pretrained"
    assert "torchyard weights upload mobilenet_v3_small FILE" in error["message"]
    assert "TORCHYARD_WORKER_PRETRAINED_FROM_HUB=1" in error["message"]

    body = _archive(b"c")
    stored = _upload(client, "mobilenet_v3_small", "w.pth", body).json()
    accepted = client.post("/v1/jobs", json=spec)
    assert accepted.status_code == 201, accepted.text
    # Its claim carries the weights to fetch.
    claim = client.post("/v1/worker/nodes/node-a/claim", params={"wait": 5}, headers=auth(worker))
    assert claim.status_code == 200, claim.text
    assert claim.json()["weights"] == {
        "id": stored["id"],
        "architecture": "mobilenet_v3_small",
        "filename": "w.pth",
        "sha256": hashlib.sha256(body).hexdigest(),
        "size_bytes": len(body),
    }
    # Another architecture has no stored weights: a node that downloads from the hub will do.
    hub_spec = job_spec(train, val, model={"architecture": "squeezenet1_1", "pretrained": True})
    assert client.post("/v1/jobs", json=hub_spec).status_code == 422
    _register(client, worker, "node-hub", info={"pretrained_from_hub": True})
    assert client.post("/v1/jobs", json=hub_spec).status_code == 201
