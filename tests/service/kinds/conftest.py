"""Rows for the job kinds' unit tests: a session on a fresh SQLite database (a copy of the
migrated template), its users, a ready node, and datasets, code packages, model versions,
jobs and attempts written straight into it (no API, no server)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, CodePackage, Dataset, Job, ModelVersion, Node, Placement, Token
from service.db.types import utcnow
from service.services.kinds.base import Claim
from service.services.tokens import Principal
from service.states import JobStatus, Role


@dataclass
class Rows:
    """Writes the rows a kind reads; every row is flushed, nothing is committed."""

    session: Session
    settings: Settings

    def principal(self, name: str, role: Role = Role.USER) -> Principal:
        token = Token(name=name, role=role.value, token_hash=f"hash-of-{name}")
        self.session.add(token)
        self.session.flush()
        return Principal(id=token.id, name=name, role=role)

    def node(self, name: str, units: int, owner: Principal) -> Node:
        """A node ready now (heard from a moment ago) on the settings' engine."""
        row = Node(
            name=name,
            address=f"{name}.example",
            units=units,
            accelerator="cpu",
            token_id=owner.id,
            engine=self.settings.engine,
            last_heartbeat_at=utcnow(),
        )
        self.session.add(row)
        self.session.flush()
        return row

    def dataset(
        self, owner: Principal, name: str, classes: list[str], *, per_class: int = 4, sha: str = "d"
    ) -> Dataset:
        row = Dataset(
            owner_id=owner.id,
            name=name,
            source="upload",
            storage_path="unused",
            classes=classes,
            class_counts=dict.fromkeys(classes, per_class),
            num_images=per_class * len(classes),
            size_bytes=1000,
            sha256=sha * 64,
        )
        self.session.add(row)
        self.session.flush()
        return row

    def code(self, owner: Principal, name: str, *, files: int = 3) -> CodePackage:
        row = CodePackage(owner_id=owner.id, name=name, sha256="c" * 64, size_bytes=100, files=files)
        self.session.add(row)
        self.session.flush()
        return row

    def train_job(
        self,
        owner: Principal,
        train: Dataset,
        *,
        architecture: str = "resnet18",
        status: JobStatus = JobStatus.SUCCEEDED,
    ) -> Job:
        """A training job in ``status`` (a succeeded one has its model directory)."""
        now = utcnow()
        final = status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
        row = Job(
            owner_id=owner.id,
            name=f"{architecture}-job",
            type="train",
            status=status.value,
            spec={"model": {"architecture": architecture}},
            architecture=architecture,
            train_dataset_id=train.id,
            validation_dataset_id=train.id,
            node_count=1,
            process_count_per_node=1,
            model_sha256="e" * 64 if status is JobStatus.SUCCEEDED else None,
            failure_code="RankFailedError" if status is JobStatus.FAILED else None,
            finished_at=now if final else None,
        )
        self.session.add(row)
        self.session.flush()
        return row

    def version(
        self,
        owner: Principal,
        name: str,
        number: int,
        job: Job,
        classes: list[str],
        *,
        architecture: str = "resnet18",
        image_size: int = 64,
    ) -> ModelVersion:
        row = ModelVersion(
            owner_id=owner.id,
            name=name,
            version=number,
            job_id=job.id,
            architecture=architecture,
            classes=classes,
            image_size=image_size,
            sha256="f" * 64,
        )
        self.session.add(row)
        self.session.flush()
        return row

    def claim(self, job: Job, node: Node, *, node_rank: int = 0) -> Claim:
        """An attempt and one placement of ``job`` on ``node``, and the claim of it (the
        common fields as service.services.claims.claimed_placement fills them)."""
        attempt = Attempt(job_id=job.id, number=1, master_addr=node.address, master_port=29511)
        self.session.add(attempt)
        self.session.flush()
        placement = Placement(
            attempt_id=attempt.id,
            job_id=job.id,
            node_id=node.id,
            node_rank=node_rank,
            units=job.process_count_per_node,
            lease_token=f"lease-{node_rank}",
            lease_expires_at=utcnow() + timedelta(seconds=60),
        )
        self.session.add(placement)
        self.session.flush()
        common: dict[str, Any] = {
            "job_id": job.id,
            "job_name": job.name,
            "attempt_id": attempt.id,
            "attempt_number": attempt.number,
            "lease_token": placement.lease_token,
            "lease_expires_at": placement.lease_expires_at,
            "node_rank": placement.node_rank,
            "node_count": job.node_count,
            "process_count_per_node": job.process_count_per_node,
            "world_size": job.node_count * job.process_count_per_node,
            "master_addr": attempt.master_addr,
            "master_port": attempt.master_port,
            "restarts": 0,
            "heartbeat_interval_s": self.settings.heartbeat_interval_s,
            "lease_timeout_s": self.settings.lease_timeout_s,
        }
        return Claim(attempt, placement, common, self.settings)


@pytest.fixture
def session(settings: Settings) -> Iterator[Session]:
    db = Database(settings.sqlalchemy_url)
    try:
        with db.session() as s:
            yield s
    finally:
        db.dispose()


@pytest.fixture
def rows(session: Session, settings: Settings) -> Rows:
    return Rows(session, settings)


@pytest.fixture
def alice(rows: Rows) -> Principal:
    return rows.principal("alice")


@pytest.fixture
def bob(rows: Rows) -> Principal:
    return rows.principal("bob")


@pytest.fixture
def node(rows: Rows, alice: Principal) -> Node:
    """One ready node of 4 units: the cluster's limits are 1 node and 4 processes per node."""
    return rows.node("n1", 4, alice)
