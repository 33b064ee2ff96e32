"""Row factories and small API helpers shared by the tests."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi.testclient import TestClient

from service.config import Settings
from service.db.engine import Database
from service.db.models import Dataset

Client = TestClient | httpx.Client


def create_token(client: Client, role: str, name: str | None = None) -> str:
    """A new token made through the API with the client's (admin) credentials."""
    r = client.post("/v1/tokens", json={"name": name or f"{role}-token", "role": role})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def register_node(
    client: Client, worker_token: str, name: str, units: int, address: str = "127.0.0.1"
) -> None:
    r = client.post(
        "/v1/worker/nodes",
        json={"name": name, "address": address, "units": units, "accelerator": "cpu"},
        headers=auth(worker_token),
    )
    assert r.status_code == 200, r.text


def insert_dataset(
    settings: Settings,
    owner_token_id: str,
    *,
    classes: list[str] | None = None,
    name: str = "ds",
    per_class: int = 3,
) -> str:
    """A dataset row as the upload route would leave it (for job API tests that need no files)."""
    classes = classes or ["a", "b", "c"]
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            row = Dataset(
                owner_id=owner_token_id,
                name=name,
                source="upload",
                storage_path="unused",
                classes=sorted(classes),
                class_counts=dict.fromkeys(sorted(classes), per_class),
                num_images=per_class * len(classes),
                size_bytes=1000,
                sha256="0" * 64,
            )
            session.add(row)
            session.flush()
            return row.id
    finally:
        db.dispose()


def token_id(client: Client, token: str) -> str:
    """The id of a token, via the token's own view of itself."""
    r = client.get("/v1/whoami", headers=auth(token))
    assert r.status_code == 200, r.text
    value: str = r.json()["id"]
    return value


def job_spec(train: str, val: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "test-job",
        "model": {"architecture": "resnet18"},
        "train_dataset": train,
        "validation_dataset": val,
    }
    spec.update(overrides)
    return spec
