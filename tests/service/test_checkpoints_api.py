"""The checkpoint store over real HTTP, on SQLite and PostgreSQL: upload under a lease,
checksums, the latest two kept, fencing, no cross-job reads, fallback past a corrupted
file, and nothing left once the job ends."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from service.config import Settings
from service.db.engine import Database
from service.db.models import Checkpoint, Placement
from service.services import checkpoints, claims
from service.services.leases import LEASE_HEADER
from tests.conftest import LiveServer
from tests.support.factories import auth
from tests.support.report_helpers import RunningJob, set_placement, start_running_job
from torchyard.contract.headers import CHECKPOINT_EPOCH_HEADER, CHECKPOINT_STEP_HEADER, SHA256_HEADER

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


@pytest.fixture
def admin(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as c:
        yield c


def _url(job: RunningJob) -> str:
    return f"/v1/worker/jobs/{job.job_id}/checkpoint"


def _put(
    client: httpx.Client,
    job: RunningJob,
    body: bytes,
    *,
    epoch: int,
    step: int | None = None,
    sha256: str | None = None,
    lease: str | None = None,
) -> httpx.Response:

    headers = {
        LEASE_HEADER: lease or job.lease,
        SHA256_HEADER: sha256 or hashlib.sha256(body).hexdigest(),
        CHECKPOINT_EPOCH_HEADER: str(epoch),
    }
    if step is not None:
        headers[CHECKPOINT_STEP_HEADER] = str(step)
    return client.put(_url(job), content=body, headers=headers)


def _get(client: httpx.Client, job: RunningJob, lease: str | None = None) -> httpx.Response:
    return client.get(_url(job), headers={LEASE_HEADER: lease or job.lease})


def _files(settings: Settings, job_id: str) -> list[Path]:
    folder = settings.data_dir / "checkpoints" / job_id
    return sorted(folder.glob("*.pt")) if folder.is_dir() else []


def _incoming_is_empty(settings: Settings) -> bool:
    incoming = settings.data_dir / "checkpoints" / ".incoming"
    return not incoming.exists() or not list(incoming.iterdir())


def test_store_keeps_two_verifies_and_fences(
    settings: Settings, live_server: LiveServer, admin: httpx.Client
) -> None:
    job = start_running_job(settings, admin, node_count=2)
    other = start_running_job(settings, admin, worker_token=job.worker_token, name="other-job")
    bodies = [bytes([i]) * (10_000 + i) for i in range(3)]
    with httpx.Client(base_url=live_server.url, headers=auth(job.worker_token)) as worker:
        assert _get(worker, job).status_code == 404  # none yet

        # Refused before anything is kept: checksum mismatch, bad headers, node rank 1, stale lease.
        r = _put(worker, job, bodies[0], epoch=1, sha256="0" * 64)
        assert r.status_code == 422 and "sha256 mismatch" in r.json()["message"]
        assert _put(worker, job, bodies[0], epoch=1, sha256="xyz").status_code == 422
        r = worker.put(
            _url(job), content=bodies[0], headers={LEASE_HEADER: job.lease, SHA256_HEADER: "0" * 64}
        )
        assert r.status_code == 422 and CHECKPOINT_EPOCH_HEADER in r.json()["message"]
        assert _put(worker, job, bodies[0], epoch=-1).status_code == 422
        r = _put(worker, job, bodies[0], epoch=1, lease=job.leases[1])
        assert r.status_code == 403 and r.json()["code"] == "PermissionDeniedError"
        r = _put(worker, job, bodies[0], epoch=1, lease="not-a-lease")
        assert r.status_code == 409 and r.json()["code"] == "StaleLeaseError"
        # Another job's lease cannot write this job's checkpoints.
        r = _put(worker, job, bodies[0], epoch=1, lease=other.lease)
        assert r.status_code == 409 and r.json()["code"] == "StaleLeaseError"
        assert _files(settings, job.job_id) == [] and _incoming_is_empty(settings)

        for epoch, body in enumerate(bodies, start=1):
            r = _put(worker, job, body, epoch=epoch, step=3 if epoch == 3 else None)
            assert r.status_code == 200, r.text
            assert r.json()["sha256"] == hashlib.sha256(body).hexdigest() and r.json()["epoch"] == epoch
        # The latest two are kept; the oldest record and file are gone.
        assert len(_files(settings, job.job_id)) == 2 and _incoming_is_empty(settings)

        r = _get(worker, job)
        assert r.status_code == 200 and r.content == bodies[2]
        assert r.headers[SHA256_HEADER] == hashlib.sha256(bodies[2]).hexdigest()
        assert r.headers[CHECKPOINT_EPOCH_HEADER] == "3" and r.headers[CHECKPOINT_STEP_HEADER] == "3"
        # Node rank 1 of the same attempt may read it; another job's lease may not.
        assert _get(worker, job, lease=job.leases[1]).content == bodies[2]
        r = _get(worker, job, lease=other.lease)
        assert r.status_code == 409 and r.json()["code"] == "StaleLeaseError"
        assert _get(worker, other).status_code == 404

        # The newest file is corrupted on disk: the previous checkpoint is served instead.
        newest = max(_files(settings, job.job_id), key=lambda p: p.stat().st_mtime_ns)
        newest.write_bytes(b"\0" * len(bodies[2]))
        r = _get(worker, job)
        assert r.status_code == 200 and r.content == bodies[1]
        assert r.headers[CHECKPOINT_EPOCH_HEADER] == "2" and CHECKPOINT_STEP_HEADER not in r.headers

        # A finished placement's lease is stale for both directions.
        set_placement(settings, job.placement_ids[0], status="done")
        assert _put(worker, job, bodies[0], epoch=4).status_code == 409
        assert _get(worker, job).status_code == 409


def test_claim_names_the_checkpoint_and_job_end_deletes_it(
    settings: Settings, live_server: LiveServer, admin: httpx.Client
) -> None:
    job = start_running_job(settings, admin)
    body = b"state" * 5000
    with httpx.Client(base_url=live_server.url, headers=auth(job.worker_token)) as worker:
        assert _put(worker, job, body, epoch=2, step=5).status_code == 200
        db = Database(settings.sqlalchemy_url)
        try:
            with db.read_session() as session:
                placement = session.get_one(Placement, job.placement_ids[0])
                ref = claims.claimed_placement(session, placement, settings).checkpoint
            assert ref is not None and (ref.epoch, ref.step, ref.attempt) == (2, 5, 1)
            assert ref.sha256 == hashlib.sha256(body).hexdigest() and ref.size_bytes == len(body)

            # The job ends through the worker protocol: its records go, then the reaper's files pass.
            r = worker.post(
                "/v1/worker/placements/status",
                headers={LEASE_HEADER: job.lease},
                json={
                    "state": "failed",
                    "exit_code": 1,
                    "failure": {"code": "TrainingDivergedError", "message": "the loss became nan"},
                },
            )
            assert r.status_code == 200, r.text
            assert admin.get(f"/v1/jobs/{job.job_id}").json()["status"] == "failed"
            with db.read_session() as session:
                left = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.job_id)).all()
            assert left == []
            # The API's own upkeep may have removed them already; either way they go.
            checkpoints.remove_ended_jobs_files(db, checkpoints.CheckpointStore(settings.data_dir))
            assert _files(settings, job.job_id) == []
        finally:
            db.dispose()


def _write_checkpoint(run_dir: Path, epoch: int) -> dict[str, object]:
    from worker.trainer import checkpoint as ckpt

    state = {"job_id": "j", "epoch": epoch, "step": 7 * epoch, "weights": bytes([epoch]) * 20_000}
    return ckpt.save_checkpoint(run_dir / ckpt.CHECKPOINT_FILE, state)


def test_agent_uploads_only_the_newest_and_downloads_it_verified(
    settings: Settings, live_server: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    from worker.agent.checkpoints import CheckpointUploader, download_checkpoint

    job = start_running_job(settings, admin)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with httpx.Client(base_url=live_server.url, headers=auth(job.worker_token)) as worker:
        # Three checkpoints written before the uploader looks: only the newest goes up.
        newest = [_write_checkpoint(run_dir, epoch) for epoch in (1, 2, 3)][-1]
        uploader = CheckpointUploader(worker, job.job_id, job.lease, run_dir)
        uploader.start()
        assert uploader.flush(60)
        uploader.stop()
        assert [(u.epoch, u.sha256) for u in uploader.uploaded] == [(3, newest["sha256"])]
        assert len(_files(settings, job.job_id)) == 1

        # A new attempt's node fetches it, checked against the API's sha256.
        fetched = tmp_path / "next-attempt"
        fetched.mkdir()
        got = download_checkpoint(worker, job.job_id, job.lease, fetched)
        assert got["sha256"] == newest["sha256"] and got["epoch"] == 3
        assert (fetched / "checkpoint.pt").read_bytes() == (run_dir / "checkpoint.pt").read_bytes()

        # An uploader whose lease is gone stops at the first refusal (the run is then stopped).
        _write_checkpoint(run_dir, 4)
        stale = CheckpointUploader(worker, job.job_id, "not-a-lease", run_dir)
        stale.start()
        deadline = time.monotonic() + 30
        while not stale.lease_lost and time.monotonic() < deadline:
            time.sleep(0.05)
        stale.stop()
        assert stale.lease_lost and stale.uploaded == []


def test_agent_sends_the_described_sha_and_skips_a_file_changed_in_place(
    settings: Settings,
    live_server: LiveServer,
    admin: httpx.Client,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The uploader does not hash the file again when the opened file is the one
    ``checkpoint.json`` describes (inode, size, mtime): it sends the trainer's sha256. The
    API still checks the bytes: a file changed in place behind an unchanged description
    is refused (422, nothing kept), and the uploader skips it until a newer checkpoint."""
    from worker.agent.checkpoints import CheckpointUploader

    job = start_running_job(settings, admin)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    info = _write_checkpoint(run_dir, 1)
    path = run_dir / "checkpoint.pt"
    stat = os.stat(path)
    with open(path, "r+b") as fh:  # one byte flipped in place, the modification time put back
        fh.seek(stat.st_size // 2)
        byte = fh.read(1)
        fh.seek(stat.st_size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert hashlib.sha256(path.read_bytes()).hexdigest() != info["sha256"]
    with httpx.Client(base_url=live_server.url, headers=auth(job.worker_token)) as worker:
        uploader = CheckpointUploader(worker, job.job_id, job.lease, run_dir)
        with caplog.at_level("WARNING", logger="worker.agent.checkpoints"):
            uploader.start()
            assert uploader.flush(60)
        # Sent with the described sha256 (not hashed first), refused by the API, then skipped.
        assert "does not match the sha256 of checkpoint.json" in caplog.text
        assert uploader.uploaded == [] and _files(settings, job.job_id) == []

        newer = _write_checkpoint(run_dir, 2)
        assert uploader.flush(60)
        uploader.stop()
        assert [(u.epoch, u.sha256) for u in uploader.uploaded] == [(2, newer["sha256"])]
        assert len(_files(settings, job.job_id)) == 1
