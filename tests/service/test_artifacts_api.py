"""Model upload (worker) and download (user and worker) over real HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.config import Settings
from service.services.leases import LEASE_HEADER
from tests.conftest import LiveServer
from tests.support.factories import auth, create_token
from tests.support.report_helpers import (
    RunningJob,
    finish_job,
    set_placement,
    start_running_job,
    write_fake_model_dir,
)
from torchyard.contract.errors import InvalidModelDirectoryError, PermissionDeniedError, StaleLeaseError
from torchyard.contract.model_archive import SHA256_HEADER, pack_model_dir
from worker.agent.reporting import download_model, upload_model


@pytest.fixture
def admin(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as c:
        yield c


def _worker(server: LiveServer, job: RunningJob) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=auth(job.worker_token))


def _store_is_empty(settings: Settings) -> bool:
    models = settings.data_dir / "models"
    return not models.exists() or not [p for p in models.rglob("*") if p.is_file()]


def _put(
    client: httpx.Client, job: RunningJob, body: bytes, sha256: str, node_rank: int = 0
) -> httpx.Response:
    return client.put(
        f"/v1/worker/jobs/{job.job_id}/model",
        content=body,
        headers={LEASE_HEADER: job.leases[node_rank], SHA256_HEADER: sha256},
    )


def test_bad_uploads_keep_nothing(
    settings: Settings, live_server: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    job = start_running_job(settings, admin, node_count=2)
    sha, _ = pack_model_dir(write_fake_model_dir(tmp_path / "model"), tmp_path / "m.tar.gz")
    body = (tmp_path / "m.tar.gz").read_bytes()
    with _worker(live_server, job) as worker:
        mismatch = _put(worker, job, body, "0" * 64)
        assert mismatch.status_code == 422, mismatch.text
        assert (
            mismatch.json()["code"] == "ValidationError" and "sha256 mismatch" in mismatch.json()["message"]
        )

        garbage = b"not an archive"
        r = _put(worker, job, garbage, hashlib.sha256(garbage).hexdigest())
        assert r.status_code == 422 and r.json()["code"] == "InvalidModelDirectoryError"

        assert _put(worker, job, body, "xyz").status_code == 422
        r = _put(worker, job, body, sha, node_rank=1)
        assert r.status_code == 403 and r.json()["code"] == "PermissionDeniedError"
        r = worker.put(f"/v1/worker/jobs/{job.job_id}/model", content=body, headers={SHA256_HEADER: sha})
        assert r.status_code == 409 and r.json()["code"] == "StaleLeaseError"

    assert _store_is_empty(settings)
    shown = admin.get(f"/v1/jobs/{job.job_id}").json()
    assert shown["model_sha256"] is None and shown["model_size"] is None

    with pytest.raises(PermissionDeniedError), _worker(live_server, job) as worker:
        upload_model(worker, job.job_id, job.leases[1], tmp_path / "model")
    set_placement(settings, job.placement_ids[0], status="done")
    with pytest.raises(StaleLeaseError), _worker(live_server, job) as worker:
        upload_model(worker, job.job_id, job.lease, tmp_path / "model")
    assert _store_is_empty(settings)


def test_upload_over_the_size_limit_is_refused(make_settings: Any, tmp_path: Path) -> None:
    settings: Settings = make_settings(model_max_bytes=2048)
    with TestClient(create_app(settings)) as client:
        client.headers.update(auth(settings.admin_token_path.read_text().strip()))
        job = start_running_job(settings, client)
        body = b"x" * 4096
        r = client.put(
            f"/v1/worker/jobs/{job.job_id}/model",
            content=body,
            headers={**job.worker_headers(), SHA256_HEADER: hashlib.sha256(body).hexdigest()},
        )
        assert r.status_code == 413 and r.json()["code"] == "PayloadTooLargeError"

        def chunks() -> Iterator[bytes]:  # no Content-Length: caught while reading
            yield from (b"x" * 1024 for _ in range(4))

        r = client.put(
            f"/v1/worker/jobs/{job.job_id}/model",
            content=chunks(),
            headers={**job.worker_headers(), SHA256_HEADER: hashlib.sha256(body).hexdigest()},
        )
        assert r.status_code == 413
    assert _store_is_empty(settings)


def test_upload_then_download_with_etag_and_ranges(
    settings: Settings, live_server: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    job = start_running_job(settings, admin, name="digits resnet/18 ✓")
    folder = write_fake_model_dir(tmp_path / "run" / "model", weights=bytes(range(256)) * 4000)
    with _worker(live_server, job) as worker:
        sha = upload_model(worker, job.job_id, job.lease, folder)
    archive = (settings.data_dir / "models" / f"{job.job_id}.tar.gz").read_bytes()
    assert hashlib.sha256(archive).hexdigest() == sha
    assert not list((settings.data_dir / "models" / ".incoming").iterdir())
    assert not [p for p in (tmp_path / "run").iterdir() if p.name != "model"]  # temp archive removed
    shown = admin.get(f"/v1/jobs/{job.job_id}").json()
    assert shown["model_sha256"] == sha and shown["model_size"] == len(archive)

    user = httpx.Client(base_url=live_server.url, headers=auth(job.user_token))
    url = f"/v1/jobs/{job.job_id}/model"
    early = user.get(url)
    assert early.status_code == 409 and early.json()["code"] == "ModelNotReadyError"

    finish_job(settings, job, "succeeded")
    full = user.get(url)
    assert full.status_code == 200
    assert full.content == archive
    assert full.headers["ETag"] == f'"{sha}"'
    assert full.headers["Accept-Ranges"] == "bytes"
    assert full.headers["Content-Length"] == str(len(archive))
    assert full.headers["Content-Type"] == "application/gzip"
    disposition = full.headers["Content-Disposition"]
    assert disposition.startswith('attachment; filename="digits_resnet_18_-')
    assert (
        f"{job.job_id}.tar.gz" in disposition
        and "filename*=UTF-8''digits%20resnet%2F18%20%E2%9C%93-" in disposition
    )

    # Resume: two range requests concatenate to the same file.
    half = len(archive) // 3
    first = user.get(url, headers={"Range": f"bytes=0-{half - 1}"})
    assert first.status_code == 206 and first.headers["Content-Range"] == f"bytes 0-{half - 1}/{len(archive)}"
    rest = user.get(url, headers={"Range": f"bytes={half}-", "If-Range": f'"{sha}"'})
    assert (
        rest.status_code == 206
        and rest.headers["Content-Range"] == f"bytes {half}-{len(archive) - 1}/{len(archive)}"
    )
    assert first.content + rest.content == archive
    assert hashlib.sha256(first.content + rest.content).hexdigest() == sha
    suffix = user.get(url, headers={"Range": "bytes=-100"})
    assert suffix.status_code == 206 and suffix.content == archive[-100:]
    clipped = user.get(url, headers={"Range": f"bytes=10-{len(archive) * 2}"})
    assert clipped.status_code == 206 and clipped.content == archive[10:]

    # A changed file (other ETag in If-Range), several ranges or nonsense: the whole archive.
    for headers in (
        {"Range": "bytes=0-9", "If-Range": '"0000"'},
        {"Range": "bytes=0-9,20-29"},
        {"Range": "lines=1-2"},
        {"Range": "bytes=9-2"},
    ):
        r = user.get(url, headers=headers)
        assert r.status_code == 200 and r.content == archive, headers

    unsatisfiable = user.get(url, headers={"Range": f"bytes={len(archive)}-"})
    assert unsatisfiable.status_code == 416
    assert unsatisfiable.headers["Content-Range"] == f"bytes */{len(archive)}"
    assert unsatisfiable.json()["code"] == "RangeNotSatisfiableError"

    for tag in (f'"{sha}"', f'W/"{sha}"', f'"other", "{sha}"', "*"):
        cached = user.get(url, headers={"If-None-Match": tag})
        assert cached.status_code == 304 and cached.content == b"", tag
        assert cached.headers["ETag"] == f'"{sha}"'
    assert user.get(url, headers={"If-None-Match": '"other"'}).status_code == 200

    head = user.head(url)
    assert head.status_code == 200 and head.headers["Content-Length"] == str(len(archive))
    assert head.content == b""

    stranger = httpx.Client(base_url=live_server.url, headers=auth(create_token(admin, "user")))
    assert stranger.get(url).status_code == 404
    assert admin.get(url).content == archive

    # The worker route serves it for fine-tuning; download_model unpacks and verifies it.
    with _worker(live_server, job) as worker:
        assert worker.get(url).status_code == 403  # user route
        dest = download_model(worker, job.job_id, tmp_path / "init" / "model")
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert (dest / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    user.close()
    stranger.close()


def test_worker_download_needs_a_succeeded_job(
    settings: Settings, live_server: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    job = start_running_job(settings, admin)
    with _worker(live_server, job) as worker:
        r = worker.get(f"/v1/worker/jobs/{job.job_id}/model")
        assert r.status_code == 409 and r.json()["code"] == "ModelNotReadyError"
        assert worker.get("/v1/worker/jobs/nope/model").status_code == 404
        user = httpx.Client(base_url=live_server.url, headers=auth(job.user_token))
        assert user.get(f"/v1/worker/jobs/{job.job_id}/model").status_code == 403
        user.close()
        # A corrupted download is refused before anything is unpacked.
        upload_model(worker, job.job_id, job.lease, write_fake_model_dir(tmp_path / "model"))
        finish_job(settings, job, "succeeded")
        stored = settings.data_dir / "models" / f"{job.job_id}.tar.gz"
        data = bytearray(stored.read_bytes())
        data[-30] ^= 0xFF
        stored.write_bytes(bytes(data))
        with pytest.raises(InvalidModelDirectoryError, match="corrupted"):
            download_model(worker, job.job_id, tmp_path / "init" / "model")
    assert not (tmp_path / "init" / "model").exists()


def test_a_real_model_directory_round_trips_to_the_loader(
    settings: Settings, live_server: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    torchvision = pytest.importorskip("torchvision")
    from torchyard.modeldir import load_model, write_model_dir

    model = torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=3)
    config = {"architecture": "mobilenet_v3_small", "classes": ["a", "b", "c"], "image_size": 32}
    folder = write_model_dir(tmp_path / "run" / "model", model, config, {"best": {"val.loss": 0.1}})
    job = start_running_job(settings, admin)
    with _worker(live_server, job) as worker:
        upload_model(worker, job.job_id, job.lease, folder)
        finish_job(settings, job, "succeeded")
        dest = download_model(worker, job.job_id, tmp_path / "init")
    loaded, classes, _ = load_model(dest)
    assert classes == ["a", "b", "c"]
    state = loaded.state_dict()
    for key, value in model.state_dict().items():
        assert bool((state[key] == value).all()), key
