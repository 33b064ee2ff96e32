"""Rows and files for the reporting tests: a running job whose nodes hold live leases.

The job, its attempt, nodes and placements are written straight into the database, as
a claim would leave them, so these tests do not depend on the scheduler.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from service.api.app import create_app
from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Job, LogChunk, Metric, Node, Placement, Team
from service.db.types import utcnow
from service.schemas.jobs import ScriptJobCreate, TrainJobCreate
from service.services.leases import LEASE_HEADER
from tests.conftest import LiveServer
from tests.support.factories import auth, create_token, insert_dataset, token_id
from tests.support.script_helpers import code_archive

Client = TestClient | httpx.Client
# Far enough ahead that the reaper never finds these leases or nodes silent during a test.
_FAR = timedelta(days=1)


@dataclass
class RunningJob:
    job_id: str
    attempt_id: str
    user_token: str
    worker_token: str
    node_names: list[str]
    leases: list[str]
    placement_ids: list[str]
    per_node: int

    @property
    def lease(self) -> str:
        return self.leases[0]

    def worker_headers(self, node_rank: int = 0) -> dict[str, str]:
        return {**auth(self.worker_token), LEASE_HEADER: self.leases[node_rank]}


def start_running_job(
    settings: Settings,
    client: Client,
    *,
    node_count: int = 1,
    per_node: int = 2,
    user_token: str | None = None,
    worker_token: str | None = None,
    name: str = "digits-resnet18",
    parameters: dict[str, Any] | None = None,
    team: str | None = None,
) -> RunningJob:
    """A ``running`` job of a new user on new nodes of a new worker token, attempt 1 live
    (of the team named ``team``; of none when it is None)."""
    user_token = user_token or create_token(client, "user")
    worker_token = worker_token or create_token(client, "worker")
    owner = token_id(client, user_token)
    worker_id = token_id(client, worker_token)
    dataset = insert_dataset(settings, owner)
    spec = TrainJobCreate.model_validate(
        {
            "name": name,
            "model": {"architecture": "resnet18"},
            "train_dataset": dataset,
            "validation_dataset": dataset,
            "resources": {"node_count": node_count, "process_count_per_node": per_node},
            "parameters": parameters or {},
        }
    ).model_dump(mode="json")
    db = Database(settings.sqlalchemy_url)
    now = utcnow()
    try:
        with db.transaction() as session:
            team_id = session.scalars(select(Team.id).where(Team.name == team)).one() if team else None
            job = Job(
                owner_id=owner,
                team_id=team_id,
                name=name,
                status="running",
                spec=spec,
                architecture="resnet18",
                train_dataset_id=dataset,
                validation_dataset_id=dataset,
                node_count=node_count,
                process_count_per_node=per_node,
                attempts_count=1,
                created_at=now,
                updated_at=now,
                scheduled_at=now,
                started_at=now,
            )
            session.add(job)
            session.flush()
            attempt = Attempt(
                job_id=job.id, number=1, status="running", master_addr="127.0.0.1", master_port=29500
            )
            session.add(attempt)
            session.flush()
            names, leases, placements = [], [], []
            for node_rank in range(node_count):
                node = Node(
                    name=f"node-{uuid.uuid4().hex[:8]}",
                    address="127.0.0.1",
                    units=per_node,
                    accelerator="cpu",
                    token_id=worker_id,
                    last_heartbeat_at=now + _FAR,
                )
                session.add(node)
                session.flush()
                placement = Placement(
                    attempt_id=attempt.id,
                    job_id=job.id,
                    node_id=node.id,
                    node_rank=node_rank,
                    units=per_node,
                    status="running",
                    lease_token=secrets.token_hex(16),
                    lease_expires_at=now + _FAR,
                )
                session.add(placement)
                session.flush()
                names.append(node.name)
                leases.append(placement.lease_token)
                placements.append(placement.id)
            return RunningJob(
                job_id=job.id,
                attempt_id=attempt.id,
                user_token=user_token,
                worker_token=worker_token,
                node_names=names,
                leases=leases,
                placement_ids=placements,
                per_node=per_node,
            )
    finally:
        db.dispose()


def make_script_job(
    settings: Settings, client: Client, job: RunningJob, command: Sequence[str] = ("python", "train.py")
) -> str:
    """Make a running job a script job, as submitting one and its claim would leave it: a
    code package of its owner's and a script spec (no model, no datasets), so that its
    reports may carry MLflow runs (``tracking``). Returns the code package's id."""
    archive = code_archive({"train.py": "print(1)\n"})
    r = client.post(
        "/v1/code",
        files={"file": ("src.tar.gz", archive, "application/gzip")},
        headers=auth(job.user_token),
    )
    assert r.status_code == 201, r.text
    code = str(r.json()["id"])
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            row = session.get_one(Job, job.job_id)
            resources = {"node_count": row.node_count, "process_count_per_node": row.process_count_per_node}
            row.spec = ScriptJobCreate.model_validate(
                {
                    "type": "script",
                    "name": row.name,
                    "code": code,
                    "command": list(command),
                    "resources": resources,
                }
            ).model_dump(mode="json")
            row.type, row.code_id = "script", code
            row.architecture = row.train_dataset_id = row.validation_dataset_id = None
    finally:
        db.dispose()
    return code


def set_placement(settings: Settings, placement_id: str, **values: Any) -> None:
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(update(Placement).where(Placement.id == placement_id).values(**values))
    finally:
        db.dispose()


def finish_job(settings: Settings, job: RunningJob, status: str = "succeeded") -> None:
    """End the job as its agents would: placements done, attempt and job ``status``."""
    db = Database(settings.sqlalchemy_url)
    now = utcnow()
    extra: dict[str, Any] = {}
    if status == "failed":
        extra = {"failure_code": "RankFailedError", "failure_message": "rank 0 failed"}
    try:
        with db.transaction() as session:
            session.execute(
                update(Placement).where(Placement.job_id == job.job_id).values(status="done", finished_at=now)
            )
            session.execute(
                update(Attempt).where(Attempt.id == job.attempt_id).values(status=status, finished_at=now)
            )
            session.execute(
                update(Job).where(Job.id == job.job_id).values(status=status, finished_at=now, **extra)
            )
    finally:
        db.dispose()


def stored_counts(settings: Settings, job_id: str) -> tuple[int, int]:
    """(metric points, log chunks) stored for the job."""
    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as session:
            metrics = session.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == job_id))
            logs = session.scalar(select(func.count()).select_from(LogChunk).where(LogChunk.job_id == job_id))
            return int(metrics or 0), int(logs or 0)
    finally:
        db.dispose()


def point(name: str, value: float, epoch: int, step: int, rank: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "value": value,
        "epoch": epoch,
        "step": step,
        "rank": rank,
        "time": "2030-01-01T00:00:00+00:00",
    }


def post_report(client: Client, job: RunningJob, node_rank: int = 0, **batch: Any) -> httpx.Response:
    return client.post(
        f"/v1/worker/jobs/{job.job_id}/reports", json=batch, headers=job.worker_headers(node_rank)
    )


def read_all_logs(client: Client, job: RunningJob, stream: str, limit_bytes: int = 1 << 20) -> bytes:
    """A whole stream, page by page, following X-Next-Offset."""
    out = b""
    offset = 0
    while True:
        r = client.get(
            f"/v1/jobs/{job.job_id}/logs",
            params={"stream": stream, "offset": offset, "limit_bytes": limit_bytes},
            headers=auth(job.user_token),
        )
        assert r.status_code == 200, r.text
        out += r.content
        next_offset = int(r.headers["X-Next-Offset"])
        if next_offset == offset:
            return out
        offset = next_offset


def all_metrics(client: Client, job: RunningJob) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    after = 0
    while True:
        r = client.get(
            f"/v1/jobs/{job.job_id}/metrics",
            params={"after": after, "limit": 500},
            headers=auth(job.user_token),
        )
        assert r.status_code == 200, r.text
        page = r.json()
        if not page["items"]:
            return items
        items.extend(page["items"])
        after = page["next_after"]


# --- model directories -------------------------------------------------------------------------


def write_fake_model_dir(folder: Path, weights: bytes = b"weights" * 1000) -> Path:
    """A model directory with the right files and manifest (the weights are not a real model)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": json.dumps({"architecture": "resnet18", "classes": ["a", "b"]}).encode(),
        "model.safetensors": weights,
        "metrics.json": json.dumps({"best": {"val.loss": 0.5}}).encode(),
    }
    lines = []
    for name, data in sorted(files.items()):
        (folder / name).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    (folder / "SHA256SUMS").write_text("".join(lines))
    return folder


# --- servers -------------------------------------------------------------------------------


def serve_on(settings: Settings, port: int) -> LiveServer:
    """A live server on a given port (to bring the API back where agents expect it)."""
    server = LiveServer(settings)
    server.port = port
    config = uvicorn.Config(
        create_app(settings), host=server.host, port=port, log_level="warning", lifespan="on"
    )
    server.server = uvicorn.Server(config)
    server.thread = threading.Thread(target=server.server.run, daemon=True)
    return server.start()
