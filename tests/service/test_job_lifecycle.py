"""A job after it ran: delete (with retention), tags and a note, clone, the log's tail and
since, and what the job routes answer for references and results that are not there."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, func, insert, select, update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Checkpoint, Job, JobEvent, LogChunk, Metric, ModelVersion
from service.db.types import utcnow
from service.services import job_delete
from service.services.artifacts import ModelStore
from service.services.checkpoints import CheckpointStore
from service.services.outputs import OutputsStore
from tests.support.factories import auth, create_token, insert_dataset, token_id
from tests.support.report_helpers import (
    RunningJob,
    finish_job,
    point,
    post_report,
    start_running_job,
    stored_counts,
)

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


def _job_files(settings: Settings, job_id: str) -> list[Any]:
    """Every kind of file the service keeps for a job, written as the stores would."""
    models, outputs = ModelStore(settings.data_dir), OutputsStore(settings.data_dir)
    checkpoints = CheckpointStore(settings.data_dir)
    files = [
        models.path(job_id),
        models.root / "unpacked" / f"{job_id}-0123456789abcdef" / "config.json",
        outputs.archive(job_id),
        outputs.node_archive(job_id, 1),
        outputs.files_dir(job_id) / "model" / "weights.bin",
        checkpoints.path(job_id, "c" * 32),
    ]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 100)
    return files


def _rows(settings: Settings, job_id: str) -> dict[str, int]:
    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as session:
            return {
                table.__tablename__: int(
                    session.scalar(select(func.count()).select_from(table).where(table.job_id == job_id)) or 0
                )
                for table in (Attempt, JobEvent, Checkpoint)
            }
    finally:
        db.dispose()


def _report(client: TestClient, job: RunningJob) -> None:
    logs = [{"stream": "rank-0", "offset": 0, "data": "".join(f"line {i}\n" for i in range(10))}]
    metrics = [point("train.loss", 1.0 / (e + 1), e, e * 10) for e in range(3)]
    assert post_report(client, job, logs=logs, metrics=metrics).status_code == 200


def test_delete_refuses_an_unfinished_job_then_removes_everything(
    client: TestClient, settings: Settings
) -> None:
    job = start_running_job(settings, client)
    user = auth(job.user_token)
    _report(client, job)
    files = _job_files(settings, job.job_id)
    other = start_running_job(settings, client, user_token=job.user_token)
    other_files = _job_files(settings, other.job_id)

    running = client.delete(f"/v1/jobs/{job.job_id}", headers=user)
    assert running.status_code == 409, running.text
    assert "cancel it first" in running.json()["message"]
    assert all(p.exists() for p in files) and stored_counts(settings, job.job_id) == (3, 1)

    finish_job(settings, job, "failed")
    deleted = client.delete(f"/v1/jobs/{job.job_id[:8]}", headers=user)  # a prefix will do
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": job.job_id, "name": "digits-resnet18", "deleted": True}

    assert not any(p.exists() for p in files)
    assert stored_counts(settings, job.job_id) == (0, 0)
    assert _rows(settings, job.job_id) == {"attempts": 0, "job_events": 0, "checkpoints": 0}
    assert client.get(f"/v1/jobs/{job.job_id}", headers=user).status_code == 404
    assert client.get(f"/v1/jobs/{job.job_id}/logs", headers=user).status_code == 404
    assert client.delete(f"/v1/jobs/{job.job_id}", headers=user).status_code == 404
    listed = client.get("/v1/jobs", headers=user).json()["items"]
    assert [j["id"] for j in listed] == [other.job_id]
    # The name now means the one job left that has it.
    assert client.get("/v1/jobs/digits-resnet18", headers=user).json()["id"] == other.job_id
    # The other job of the same user lost nothing.
    assert all(p.exists() for p in other_files)


def test_delete_removes_many_points_in_batches_each_committed(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer waits for one batch at most, not for the whole job's rows."""
    monkeypatch.setattr(job_delete, "DELETE_BATCH_ROWS", 1000)
    monkeypatch.setattr(job_delete, "DELETE_BATCH_LOG_CHUNKS", 100)
    job = start_running_job(settings, client)
    kept = start_running_job(settings, client, user_token=job.user_token)
    _report(client, kept)
    now = utcnow()
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            common = {"job_id": job.job_id, "attempt_id": job.attempt_id}
            session.execute(
                insert(Metric),
                [
                    {
                        **common,
                        "name": "train.loss",
                        "value": 1.0,
                        "epoch": 1,
                        "step": s,
                        "rank": 0,
                        "time": now,
                    }
                    for s in range(3500)
                ],
            )
            session.execute(
                insert(LogChunk),
                [
                    {**common, "stream": "rank-0", "offset": 10 * i, "size": 10, "data": "0123456789"}
                    for i in range(250)
                ],
            )
    finally:
        db.dispose()
    finish_job(settings, job, "failed")
    assert stored_counts(settings, job.job_id) == (3500, 250)

    deleted: list[dict[str, int]] = []  # rows deleted by each committed transaction
    pending = {"metrics": 0, "log_chunks": 0}

    def counted(_conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        found = re.match(r"\s*DELETE FROM (metrics|log_chunks)\b", statement)
        if found:
            pending[found.group(1)] += cursor.rowcount

    def committed(_conn: Any) -> None:
        if any(pending.values()):
            deleted.append(dict(pending))
        pending.update(metrics=0, log_chunks=0)

    event.listen(Engine, "after_cursor_execute", counted)
    event.listen(Engine, "commit", committed)
    try:
        r = client.delete(f"/v1/jobs/{job.job_id}", headers=auth(job.user_token))
    finally:
        event.remove(Engine, "after_cursor_execute", counted)
        event.remove(Engine, "commit", committed)
    assert r.status_code == 200, r.text
    assert stored_counts(settings, job.job_id) == (0, 0)
    assert stored_counts(settings, kept.job_id) == (3, 1)
    assert sum(d["metrics"] for d in deleted) == 3500 and sum(d["log_chunks"] for d in deleted) == 250
    # Several transactions, none deleting more than a batch.
    assert max(d["metrics"] for d in deleted) == 1000 and max(d["log_chunks"] for d in deleted) == 100
    assert len(deleted) >= 4 + 3


def test_delete_is_refused_while_the_model_is_a_registered_version(
    client: TestClient, settings: Settings
) -> None:
    job = start_running_job(settings, client)
    user = auth(job.user_token)
    finish_job(settings, job, "failed")  # the version's row is written directly: any job will do
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            owner = session.get_one(Job, job.job_id).owner_id
            session.add(
                ModelVersion(
                    owner_id=owner,
                    name="digits",
                    version=1,
                    job_id=job.job_id,
                    architecture="resnet18",
                    classes=["a", "b"],
                    image_size=32,
                    sha256="0" * 64,
                )
            )
    finally:
        db.dispose()
    refused = client.delete(f"/v1/jobs/{job.job_id}", headers=user)
    assert refused.status_code == 409, refused.text
    assert refused.json()["details"]["model_versions"] == ["digits:1"]
    assert "torchyard model delete digits:1" in refused.json()["message"]

    assert client.delete("/v1/models/digits/versions/1", headers=user).status_code == 200
    assert client.delete(f"/v1/jobs/{job.job_id}", headers=user).status_code == 200


def test_retention_deletes_jobs_finished_long_enough_ago(make_settings: Any, client: TestClient) -> None:
    settings = make_settings(retention_s=3600)
    old = start_running_job(settings, client)
    recent = start_running_job(settings, client, user_token=old.user_token)
    running = start_running_job(settings, client, user_token=old.user_token)
    for job in (old, recent):
        _report(client, job)
        finish_job(settings, job, "cancelled")
    old_files = _job_files(settings, old.job_id)
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(
                update(Job).where(Job.id == old.job_id).values(finished_at=utcnow() - timedelta(hours=2))
            )
        assert job_delete.apply_retention(db, settings) == 1
        assert job_delete.apply_retention(db, settings) == 0
        assert job_delete.apply_retention(db, make_settings()) == 0  # unset: nothing is removed
    finally:
        db.dispose()
    user = auth(old.user_token)
    assert not any(p.exists() for p in old_files)
    assert stored_counts(settings, old.job_id) == (0, 0)
    assert client.get(f"/v1/jobs/{old.job_id}", headers=user).status_code == 404
    assert stored_counts(settings, recent.job_id) == (3, 1)
    assert client.get(f"/v1/jobs/{running.job_id}", headers=user).json()["status"] == "running"


def test_tags_and_note_are_set_cleared_and_checked(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    user = auth(job.user_token)
    url = f"/v1/jobs/{job.job_id}"
    assert client.get(url, headers=user).json()["tags"] == []

    r = client.patch(
        url, json={"tags": ["baseline", "lr-0.05", "baseline"], "note": "first try"}, headers=user
    )
    assert r.status_code == 200, r.text
    assert r.json()["tags"] == ["baseline", "lr-0.05"] and r.json()["note"] == "first try"
    # A field left out is kept; null clears the note.
    kept = client.patch(url, json={"note": None}, headers=user).json()
    assert kept["tags"] == ["baseline", "lr-0.05"] and kept["note"] is None
    assert client.patch(url, json={"tags": []}, headers=user).json()["tags"] == []

    bad = client.patch(url, json={"tags": ["two words"]}, headers=user)
    assert bad.status_code == 422 and "tags" in bad.text
    assert client.patch(url, json={"colour": "red"}, headers=user).status_code == 422
    stranger = create_token(client, "user")
    assert client.patch(url, json={"note": "mine"}, headers=auth(stranger)).status_code == 404
    assert client.get(url, headers=user).json()["note"] is None


def test_clone_submits_the_same_spec_as_a_new_job(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client, parameters={"epochs": 7, "learning_rate": 0.05})
    user = auth(job.user_token)
    finish_job(settings, job, "failed")
    r = client.post(f"/v1/jobs/{job.job_id}/clone", headers=user)
    assert r.status_code == 201, r.text
    clone = r.json()
    source = client.get(f"/v1/jobs/{job.job_id}", headers=user).json()
    assert clone["id"] != job.job_id and clone["status"] == "queued"
    for key in ("name", "model", "train_dataset", "validation_dataset", "parameters", "resources"):
        assert clone[key] == source[key], key
    assert clone["parameters"]["epochs"] == 7
    assert client.post("/v1/jobs/nope-nope/clone", headers=user).status_code == 404


def test_a_dataset_name_in_the_request_body_is_resolved(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)  # a user, and nodes the job fits on
    dataset_id = insert_dataset(settings, token_id(client, job.user_token), name="digits-train")
    spec = {
        "model": {"architecture": "resnet18"},
        "train_dataset": "digits-train",
        "validation_dataset": dataset_id,
    }
    user_token = job.user_token
    r = client.post("/v1/jobs", json=spec, headers=auth(user_token))
    assert r.status_code == 201, r.text
    assert r.json()["train_dataset"] == dataset_id
    missing = client.post("/v1/jobs", json={**spec, "train_dataset": "nope"}, headers=auth(user_token))
    assert missing.status_code == 404
    assert missing.json()["message"].startswith("train_dataset: dataset 'nope' not found")
    assert missing.json()["details"]["field"] == "train_dataset"


def test_log_tail_and_since(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    user = auth(job.user_token)
    first = [{"stream": "rank-0", "offset": 0, "data": "a1\na2\na3\n"}]
    assert post_report(client, job, logs=first).status_code == 200
    cut = utcnow()
    second = [
        {"stream": "rank-0", "offset": 9, "data": "b1\nb2"},
        {"stream": "rank-0", "offset": 14, "data": "-end\n"},
    ]
    assert post_report(client, job, logs=second).status_code == 200
    url = f"/v1/jobs/{job.job_id}/logs"

    def read(**params: Any) -> str:
        r = client.get(url, params=params, headers=user)
        assert r.status_code == 200, r.text
        return r.text

    assert read(tail=1) == "b2-end\n"
    assert read(tail=2) == "b1\nb2-end\n"
    assert read(tail=4) == "a2\na3\nb1\nb2-end\n"
    assert read(tail=100) == "a1\na2\na3\nb1\nb2-end\n"
    assert read(since=cut.isoformat()) == "b1\nb2-end\n"
    assert read(since=(cut + timedelta(hours=1)).isoformat()) == ""
    assert read(since=cut.isoformat(), tail=1) == "b2-end\n"
    assert client.get(url, params={"tail": 0}, headers=user).status_code == 422
    naive = client.get(url, params={"since": "2026-01-01T00:00:00"}, headers=user)
    assert naive.status_code == 422 and "since" in naive.text


def test_missing_references_and_results_say_why(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    user = auth(job.user_token)
    short = client.get("/v1/jobs/6c4", headers=user)
    assert short.status_code == 404
    assert "an id prefix needs at least 4 characters" in short.json()["message"]
    assert "at least 4" not in client.get("/v1/jobs/no-such-job", headers=user).json()["message"]
    assert client.get(f"/v1/jobs/{job.job_id}/result", headers=user).status_code == 409  # not yet
    finish_job(settings, job, "failed")
    never = client.get(f"/v1/jobs/{job.job_id}/result", headers=user)
    assert never.status_code == 404 and "will not have one" in never.json()["message"]
