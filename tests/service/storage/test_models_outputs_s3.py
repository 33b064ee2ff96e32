"""Model archives, script jobs' outputs and checkpoints with object storage (docs/storage.md),
against the private S3 server: node rank 0's agent uploads straight to the bucket under a key
per upload, downloads are redirects to presigned URLs (ranges included), a completion under a
stale lease is refused and its object removed, an interrupted multipart upload resumes and an
abandoned one is dropped, the old PUT routes store into the bucket too, and deleting the job
removes its objects.

One API (uvicorn in a thread of the test process, SQLite) serves the whole module; uploads
are cut into 5 MiB parts, so an archive of about 11 MiB is a multipart upload of three."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, ObjectUpload
from service.services import direct_uploads
from tests.conftest import LiveServer
from tests.service.test_script_jobs_api import upload_code
from tests.support.factories import auth
from tests.support.report_helpers import (
    RunningJob,
    finish_job,
    set_placement,
    start_running_job,
    write_fake_model_dir,
)
from tests.support.s3_server import S3Server
from torchyard.apiclient import direct
from torchyard.client import Client
from torchyard.contract.errors import StaleLeaseError
from torchyard.contract.headers import CHECKPOINT_EPOCH_HEADER, LEASE_HEADER, SHA256_HEADER
from torchyard.contract.model_archive import pack_model_dir
from torchyard.contract.transfer import describe_file
from worker.agent import model_transfer
from worker.agent.checkpoints import CheckpointUploader, download_checkpoint
from worker.agent.script_outputs import upload_outputs

MIB = 1024 * 1024
PART = 5 * MIB
PREFIX = "models-outputs"


class Api:
    """The module's API over S3, its bucket, and a user's and admin's clients."""

    def __init__(self, server: LiveServer, s3: S3Server, bucket: str) -> None:
        self.server = server
        self.settings = server.settings
        self.s3 = s3.client()
        self.endpoint = s3.endpoint_url
        self.bucket = bucket
        self.admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=60)

    def keys(self, prefix: str = "") -> list[str]:
        found = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{PREFIX}/{prefix}")
        return sorted(o["Key"].removeprefix(f"{PREFIX}/") for o in found.get("Contents", []))

    def multipart_uploads(self) -> list[str]:
        found = self.s3.list_multipart_uploads(Bucket=self.bucket)
        return [u["Key"].removeprefix(f"{PREFIX}/") for u in found.get("Uploads", [])]

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.server.url, headers=auth(token), timeout=60)

    def job_row(self, job_id: str) -> dict[str, Any]:
        db = Database(self.settings.sqlalchemy_url)
        try:
            with db.read_session() as session:
                job = session.get_one(Job, job_id)
                return {
                    "model_key": job.model_key,
                    "model_sha256": job.model_sha256,
                    "outputs_key": job.outputs_key,
                    "outputs_sha256": job.outputs_sha256,
                }
        finally:
            db.dispose()

    def uploads_left(self) -> int:
        db = Database(self.settings.sqlalchemy_url)
        try:
            with db.read_session() as session:
                return len(session.scalars(select(ObjectUpload.id)).all())
        finally:
            db.dispose()


@pytest.fixture(scope="module")
def api(
    s3_server: S3Server, sqlite_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Api]:
    bucket = s3_server.make_bucket()
    root = tmp_path_factory.mktemp("models-outputs-s3")
    shutil.copyfile(sqlite_template, root / "torchyard.db")
    settings = Settings(
        data_dir=root / "data",
        database_url=f"sqlite:///{root / 'torchyard.db'}",
        storage_url=f"s3://{bucket}/{PREFIX}",
    )
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_server.env().items():
            mp.setenv(name, value)
        # Agents cut uploads every 5 MiB here (S3's smallest part), not every 64 MiB.
        mp.setattr(direct, "upload", functools.partial(direct.upload, part_bytes=PART))
        server = LiveServer(settings).start()
        try:
            yield Api(server, s3_server, bucket)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory whose archive is about 11 MiB (weights do not compress)."""
    return write_fake_model_dir(tmp_path_factory.mktemp("model") / "model", weights=os.urandom(11 * MIB))


@pytest.fixture(scope="module")
def archive(model_dir: Path) -> tuple[Path, str]:
    path = model_dir.parent / "model.tar.gz"
    sha256, _ = pack_model_dir(model_dir, path)
    return path, sha256


def _ready_job(api: Api) -> tuple[RunningJob, httpx.Client]:
    job = start_running_job(api.settings, api.admin, per_node=1)
    return job, api.client(job.worker_token)


def _script_job(api: Api, **spec: Any) -> tuple[RunningJob, httpx.Client]:
    job = start_running_job(api.settings, api.admin, node_count=2 if spec else 1, per_node=1)
    admin: Any = api.admin
    code = upload_code(admin, {"train.py": b"print('hi')\n"})
    assert code.status_code == 201, code.text
    db = Database(api.settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            row = session.get_one(Job, job.job_id)
            values: dict[str, Any] = {"type": "script", "code_id": code.json()["id"]}
            if spec:
                values["spec"] = {**row.spec, **spec}
            session.execute(update(Job).where(Job.id == job.job_id).values(**values))
    finally:
        db.dispose()
    return job, api.client(job.worker_token)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parts_only(
    worker: httpx.Client, plan_url: str, path: Path, headers: dict[str, str], send: list[int] | None = None
) -> dict[str, Any]:
    """Ask for a plan and PUT its parts (only those numbered in ``send``); the plan."""
    request = describe_file(path, PART)
    answer = worker.post(plan_url, json=request.model_dump(exclude_none=True), headers=headers)
    assert answer.status_code == 200, answer.text
    plan: dict[str, Any] = answer.json()
    assert plan["mode"] == "direct"
    offset = 0
    with open(path, "rb") as fh, httpx.Client(timeout=60) as store:
        for part in plan["parts"]:
            fh.seek(offset)
            body = fh.read(part["size"])
            offset += part["size"]
            if send is None or part["number"] in send:
                put = store.put(part["url"], content=body, headers=part["headers"])
                assert put.status_code == 200, put.text
    return plan


# --- models --------------------------------------------------------------------------------


def test_a_model_goes_straight_to_the_bucket_and_downloads_by_redirect(
    api: Api, model_dir: Path, archive: tuple[Path, str], tmp_path: Path
) -> None:
    job, worker = _ready_job(api)
    path, sha256 = archive
    assert model_transfer.upload_model(worker, job.job_id, job.lease, model_dir) == sha256
    keys = api.keys(f"models/{job.job_id}")
    assert len(keys) == 1 and keys[0].startswith(f"models/{job.job_id}/") and keys[0].endswith(".tar.gz")
    assert api.job_row(job.job_id)["model_key"] == keys[0]
    assert api.uploads_left() == 0
    assert not (api.settings.data_dir / "models" / f"{job.job_id}.tar.gz").exists()

    finish_job(api.settings, job)
    body = path.read_bytes()
    with api.client(job.user_token) as user:
        url = f"/v1/jobs/{job.job_id}/model"
        answer = user.get(url)
        assert answer.status_code == 307 and answer.headers["etag"] == f'"{sha256}"'
        location = answer.headers["location"]
        assert location.startswith(api.endpoint) and "authorization" not in location.lower()
        fetched = httpx.get(location, timeout=60)
        assert fetched.status_code == 200 and _sha(fetched.content) == sha256
        ranged = user.get(url, headers={"Range": "bytes=100-5242979"}, follow_redirects=True)
        assert ranged.status_code == 206 and ranged.content == body[100:5242980]
        assert direct.api_headers(ranged)["etag"] == f'"{sha256}"'
        assert user.get(url, headers={"If-None-Match": f'"{sha256}"'}).status_code == 304

    # The CLI's download resumes a part file through the redirect, then checks and unpacks.
    dest = tmp_path / "cli-model"
    (tmp_path / "cli-model.tar.gz.part").write_bytes(body[: 3 * MIB])
    resumed: list[int] = []
    with Client(api.server.url, job.user_token, timeout=60) as client:
        client.download_model(job.job_id, dest, on_resume=resumed.append)
    assert resumed == [3 * MIB]
    assert (dest / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()

    # A node fine-tuning from it fetches it through the worker route's redirect.
    fetched_dir = model_transfer.download_model(worker, job.job_id, tmp_path / "agent-model")
    assert (fetched_dir / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()

    # Deleting the job removes its objects.
    assert api.admin.delete(f"/v1/jobs/{job.job_id}").status_code in (200, 204)
    assert api.keys(f"models/{job.job_id}") == []


def test_a_stale_leases_completed_model_upload_is_refused_and_removed(
    api: Api, archive: tuple[Path, str]
) -> None:
    job, worker = _ready_job(api)
    path, _ = archive
    plan_url = f"/v1/worker/jobs/{job.job_id}/model/upload"
    plan = _parts_only(worker, plan_url, path, {LEASE_HEADER: job.lease})
    assert len(plan["parts"]) == 3
    set_placement(api.settings, job.placement_ids[0], status="done")
    answer = worker.post(plan["complete_url"], headers={LEASE_HEADER: job.lease})
    assert answer.status_code == 409 and answer.json()["code"] == "StaleLeaseError", answer.text
    assert api.keys(f"models/{job.job_id}") == [] and job.job_id not in " ".join(api.multipart_uploads())
    assert api.job_row(job.job_id)["model_sha256"] is None and api.uploads_left() == 0


def test_an_interrupted_upload_resumes_and_an_abandoned_one_is_dropped(
    api: Api, archive: tuple[Path, str]
) -> None:
    job, worker = _ready_job(api)
    path, sha256 = archive
    plan_url = f"/v1/worker/jobs/{job.job_id}/model/upload"
    headers = {LEASE_HEADER: job.lease}
    first = _parts_only(worker, plan_url, path, headers, send=[1])
    early = worker.post(first["complete_url"], headers=headers)
    assert early.status_code == 409 and "not complete" in early.json()["message"]
    again = _parts_only(worker, plan_url, path, headers, send=[])
    assert again["upload_id"] == first["upload_id"] and again["done"] == [1]
    assert any(k.startswith(f"models/{job.job_id}/") for k in api.multipart_uploads())

    # Nobody comes back: the upkeep drops the row and the parts.
    expired = api.settings.model_copy(update={"storage_upload_expiry_s": 0.001})
    time.sleep(0.01)
    db = Database(api.settings.sqlalchemy_url)
    try:
        assert direct_uploads.drop_abandoned(db, expired) >= 1
    finally:
        db.dispose()
    assert api.uploads_left() == 0
    assert not any(k.startswith(f"models/{job.job_id}/") for k in api.multipart_uploads())
    assert api.keys(f"models/{job.job_id}") == []
    gone = worker.post(first["complete_url"], headers=headers)
    assert gone.status_code == 404

    # The agent's own upload then goes through whole.
    rest = _parts_only(worker, plan_url, path, headers)
    done = worker.post(rest["complete_url"], headers=headers)
    assert done.status_code == 200 and done.json() == {
        "sha256": sha256,
        "size": path.stat().st_size,
        "files": {},
    }


def test_the_legacy_model_put_stores_into_the_bucket(api: Api, archive: tuple[Path, str]) -> None:
    job, worker = _ready_job(api)
    path, sha256 = archive
    answer = worker.put(
        f"/v1/worker/jobs/{job.job_id}/model",
        content=path.read_bytes(),
        headers={LEASE_HEADER: job.lease, SHA256_HEADER: sha256},
    )
    assert answer.status_code == 200, answer.text
    assert set(answer.json()["files"]) == {"SHA256SUMS", "config.json", "metrics.json", "model.safetensors"}
    keys = api.keys(f"models/{job.job_id}")
    assert len(keys) == 1 and api.job_row(job.job_id)["model_key"] == keys[0]
    assert not list((api.settings.data_dir / "models" / ".incoming").glob("upload-*"))
    finish_job(api.settings, job)
    with api.client(job.user_token) as user:
        fetched = user.get(f"/v1/jobs/{job.job_id}/model", follow_redirects=True)
    assert fetched.status_code == 200 and _sha(fetched.content) == sha256


# --- outputs -------------------------------------------------------------------------------


def _outputs_folder(root: Path) -> Path:
    folder = root / "outputs"
    (folder / "plots").mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"top1": 0.9}))
    (folder / "plots" / "loss.csv").write_text("step,loss\n1,0.5\n")
    return folder


def test_outputs_go_straight_to_the_bucket_and_download_by_redirect(api: Api, tmp_path: Path) -> None:
    job, worker = _script_job(api)
    ctx: Any = SimpleNamespace(api=SimpleNamespace(client=worker))
    sha256 = upload_outputs(ctx, job.job_id, job.lease, _outputs_folder(tmp_path), archive_dir=tmp_path)
    keys = api.keys(f"outputs/{job.job_id}")
    assert len(keys) == 1 and keys[0].startswith(f"outputs/{job.job_id}/")
    row = api.job_row(job.job_id)
    assert row["outputs_key"] == keys[0] and row["outputs_sha256"] == sha256 and api.uploads_left() == 0
    with api.client(job.user_token) as user:
        url = f"/v1/jobs/{job.job_id}/outputs"
        answer = user.get(url)
        assert answer.status_code == 307 and answer.headers["etag"] == f'"{sha256}"'
        whole = user.get(url, follow_redirects=True)
        assert whole.status_code == 200 and _sha(whole.content) == sha256
        # One file is served by the API, out of a copy of the archive it fetched once.
        single = user.get(url, params={"path": "plots/loss.csv"})
        assert single.status_code == 200 and single.content == b"step,loss\n1,0.5\n"
    with Client(api.server.url, job.user_token, timeout=60) as client:
        saved = client.code.download_outputs(job.job_id, tmp_path / "outputs.tar.gz")
    assert _sha(saved.read_bytes()) == sha256

    finish_job(api.settings, job)
    assert api.admin.delete(f"/v1/jobs/{job.job_id}").status_code in (200, 204)
    assert api.keys(f"outputs/{job.job_id}") == []


def test_legacy_outputs_puts_store_into_the_bucket_every_nodes_rebuilt(api: Api) -> None:
    job, worker = _script_job(api, outputs="all")
    plan = worker.post(
        f"/v1/worker/jobs/{job.job_id}/outputs/upload",
        json=describe_file(Path(__file__)).model_dump(exclude_none=True),
        headers={LEASE_HEADER: job.lease},
    )
    assert plan.status_code == 200 and plan.json()["mode"] == "api"  # the API rebuilds the archive
    for rank in (0, 1):
        body = _tar_gz({f"rank{rank}.txt": f"node {rank}\n".encode()})
        answer = worker.put(
            f"/v1/worker/jobs/{job.job_id}/outputs",
            content=body,
            headers={**job.worker_headers(rank), SHA256_HEADER: _sha(body)},
        )
        assert answer.status_code == 200, answer.text
    keys = api.keys(f"outputs/{job.job_id}/")
    served = api.job_row(job.job_id)["outputs_key"]
    assert f"outputs/{job.job_id}/node-0.tar.gz" in keys and f"outputs/{job.job_id}/node-1.tar.gz" in keys
    assert served in keys and len(keys) == 3  # the first combined archive was replaced
    with api.client(job.user_token) as user:
        whole = user.get(f"/v1/jobs/{job.job_id}/outputs", follow_redirects=True)
    with tarfile.open(fileobj=io.BytesIO(whole.content), mode="r:gz") as tf:
        assert sorted(m.name for m in tf if m.isreg()) == ["node-0/rank0.txt", "node-1/rank1.txt"]


def _tar_gz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# --- checkpoints ---------------------------------------------------------------------------


def _write_checkpoint(run_dir: Path, body: bytes, epoch: int) -> None:
    (run_dir / "checkpoint.pt").write_bytes(body)
    info = {"sha256": _sha(body), "epoch": epoch}
    (run_dir / "checkpoint.json").write_text(json.dumps(info))


def test_checkpoints_go_straight_to_the_bucket_and_download_by_redirect(api: Api, tmp_path: Path) -> None:
    job, worker = _ready_job(api)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    body = os.urandom(6 * MIB)  # two parts
    _write_checkpoint(run_dir, body, epoch=2)
    uploader = CheckpointUploader(worker, job.job_id, job.lease, run_dir)
    uploader.start()
    try:
        assert uploader.flush(60), "the checkpoint was not uploaded"
    finally:
        uploader.stop()
    keys = api.keys(f"checkpoints/{job.job_id}/")
    assert len(keys) == 1 and keys[0].endswith(".pt") and api.uploads_left() == 0

    answer = worker.get(f"/v1/worker/jobs/{job.job_id}/checkpoint", headers={LEASE_HEADER: job.lease})
    assert answer.status_code == 307 and answer.headers[SHA256_HEADER] == _sha(body)
    restored = tmp_path / "restored"
    restored.mkdir()
    found = download_checkpoint(worker, job.job_id, job.lease, restored)
    assert found["sha256"] == _sha(body) and found["epoch"] == 2
    assert (restored / "checkpoint.pt").read_bytes() == body

    # A completion under a lease gone stale is refused, and its object removed.
    (tmp_path / "next.pt").write_bytes(b"next state" * 1000)
    plan = _parts_only(
        worker,
        f"/v1/worker/jobs/{job.job_id}/checkpoint/upload",
        tmp_path / "next.pt",
        {LEASE_HEADER: job.lease, CHECKPOINT_EPOCH_HEADER: "3"},
    )
    set_placement(api.settings, job.placement_ids[0], status="done")
    refused = worker.post(plan["complete_url"], headers={LEASE_HEADER: job.lease})
    assert refused.status_code == 409 and refused.json()["code"] == "StaleLeaseError"
    assert api.keys(f"checkpoints/{job.job_id}/") == keys and api.uploads_left() == 0
    with pytest.raises(StaleLeaseError):
        download_checkpoint(worker, job.job_id, job.lease, restored)

    # The job's end and delete remove the rest.
    finish_job(api.settings, job, "failed")
    assert api.admin.delete(f"/v1/jobs/{job.job_id}").status_code in (200, 204)
    assert api.keys(f"checkpoints/{job.job_id}/") == []
