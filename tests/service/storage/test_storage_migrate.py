"""``torchyard storage migrate`` (service/services/storage_migrate.py): a data directory's
artifacts copied into a real S3 server (SeaweedFS), verified; a run that cannot copy one of
them switches nothing, and the next run copies only what is not there yet."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Checkpoint, Dataset, Job
from service.db.types import utcnow
from service.services import datasets as dataset_service
from service.services.storage_migrate import migrate
from service.storage.s3 import S3Storage
from tests.support.report_helpers import start_running_job
from tests.support.worker_fixtures import upload_digits


def _weights(client: TestClient) -> str:
    body = b"PK\x03\x04" + os.urandom(2000)
    r = client.post(
        "/v1/weights",
        data={"architecture": "resnet18"},
        files={"file": ("resnet18-mine.pth", body, "application/octet-stream")},
    )
    assert r.status_code == 201, r.text
    sha256: str = r.json()["sha256"]
    return sha256


def _job_with_model_and_checkpoint(settings: Settings, client: TestClient) -> tuple[str, str]:
    job = start_running_job(settings, client, per_node=1)
    model = settings.data_dir / "models" / f"{job.job_id}.tar.gz"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(os.urandom(3000))
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(
                update(Job)
                .where(Job.id == job.job_id)
                .values(model_sha256=hashlib.sha256(model.read_bytes()).hexdigest(), model_size=3000)
            )
            row = Checkpoint(
                job_id=job.job_id,
                attempt_id=job.attempt_id,
                attempt_number=1,
                epoch=1,
                sha256="0" * 64,
                size_bytes=1000,
                created_at=utcnow(),
            )
            session.add(row)
            session.flush()
            checkpoint_id = row.id
    finally:
        db.dispose()
    path = settings.data_dir / "checkpoints" / job.job_id / f"{checkpoint_id}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(1000))
    return job.job_id, checkpoint_id


def test_a_data_directory_is_copied_verified_then_switched(
    client: TestClient, settings: Settings, s3_server: Any, tmp_path: Path
) -> None:
    train, val = upload_digits(client, tmp_path / "digits", per_class=5, size=16)
    weights_sha = _weights(client)
    job_id, checkpoint_id = _job_with_model_and_checkpoint(settings, client)
    bucket = s3_server.make_bucket()
    storage = S3Storage(f"s3://{bucket}/site", client=s3_server.client())
    db = Database(settings.sqlalchemy_url)
    try:
        # The weights file is unreadable as a file (a folder in its place): that artifact fails,
        # so nothing is switched, though the others are copied.
        weights = settings.data_dir / "weights" / f"{weights_sha}.pth"
        kept = tmp_path / "weights.pth"
        shutil.move(weights, kept)
        weights.mkdir()
        first = migrate(db, settings, storage, progress=lambda _line: None)
        assert [key for key, _ in first.failed] == [f"weights/{weights_sha}.pth"]
        assert f"models/{job_id}.tar.gz" in first.copied
        assert f"checkpoints/{job_id}/{checkpoint_id}.pt" in first.copied
        with db.read_session() as session:
            assert session.scalars(select(Dataset.archive_key).where(Dataset.id.in_([train, val]))).all() == [
                None,
                None,
            ]
        # The stand-in dataset of the running job has no folder: reported missing, never pointed at.
        assert len(first.missing) == 1 and first.missing[0].startswith("datasets/")

        weights.rmdir()
        shutil.move(kept, weights)
        second = migrate(db, settings, storage, progress=lambda _line: None)
        assert second.complete
        assert second.copied == [f"weights/{weights_sha}.pth"], "only what was not there yet"
        assert f"models/{job_id}.tar.gz" in second.skipped
        assert f"checkpoints/{job_id}/{checkpoint_id}.pt" in second.skipped

        with db.read_session() as session:
            rows = {d.id: d for d in session.scalars(select(Dataset).where(Dataset.id.in_([train, val])))}
        for row in rows.values():
            assert row.archive_key == f"datasets/{row.sha256}.tar"
            copied = tmp_path / f"{row.id}.tar"
            storage.get_file(row.archive_key, copied)
            # The object is exactly the tar agents were sent from the folder.
            assert copied.read_bytes() == b"".join(dataset_service.dataset_tar(settings, row))
        model_copy = tmp_path / "model.tar.gz"
        storage.get_file(f"models/{job_id}.tar.gz", model_copy)
        assert model_copy.read_bytes() == (settings.data_dir / "models" / f"{job_id}.tar.gz").read_bytes()
    finally:
        db.dispose()


def test_the_command_copies_and_says_how_to_switch(
    client: TestClient, settings: Settings, s3_server: Any, tmp_path: Path
) -> None:
    weights_sha = _weights(client)
    bucket = s3_server.make_bucket()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TORCHYARD_", "AWS_"))},
        **s3_server.env(),
        "TORCHYARD_DATA_DIR": str(settings.data_dir),
        "TORCHYARD_DATABASE_URL": settings.database_url or "",
    }
    command = [sys.executable, "-m", "torchyard.cli", "storage", "migrate", "--to", f"s3://{bucket}/site"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"copied    weights/{weights_sha}.pth" in done.stdout
    assert f"TORCHYARD_STORAGE_URL=s3://{bucket}/site" in done.stdout
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 copied (0 bytes), 1 already there" in again.stdout
    wrong = subprocess.run([*command[:-1], "https://not-a-bucket"], env=env, capture_output=True, text=True)
    assert (
        wrong.returncode != 0 and "TORCHYARD_STORAGE_URL must be s3://bucket" in wrong.stdout + wrong.stderr
    )
