"""The Python client against a live service: typed results, errors with the API's codes."""

from __future__ import annotations

import tarfile
import time
from pathlib import Path

import pytest

from service.config import Settings
from tests.conftest import LiveServer, free_port
from tests.support.factories import create_token
from torchyard.client import Client, Dataset, Job, ServiceUnreachableError, pack_directory
from torchyard.contract.errors import (
    AuthenticationError,
    InvalidDatasetError,
    NotFoundError,
    RequestValidationError,
    ResourceLimitError,
)
from torchyard.sample_data import write_digits


@pytest.fixture
def client(live_server: LiveServer) -> Client:
    return Client(live_server.url, live_server.admin_token)


def test_typed_results_and_error_codes(client: Client, live_server: LiveServer, tmp_path: Path) -> None:
    train_dir, val_dir = write_digits(tmp_path / "digits", per_class=5, size=16)
    train = client.upload_dataset(train_dir, name="digits-train")
    assert (
        isinstance(train, Dataset) and train.num_images == 40 and train.classes == [str(i) for i in range(10)]
    )
    val = client.upload_dataset(val_dir)
    assert val.name == "val"
    assert client.find_dataset("digits-train").id == train.id
    assert [d.id for d in client.iter_datasets()] == [val.id, train.id]

    spec = {"model": {"architecture": "resnet18"}, "train_dataset": train.id, "validation_dataset": val.id}
    with pytest.raises(ResourceLimitError) as limit:  # no node has registered yet
        client.submit_job(spec)
    assert limit.value.code == "ResourceLimitError" and limit.value.status_code == 422
    worker = Client(live_server.url, create_token(client._http, "worker"))
    worker._json("POST", "/v1/worker/nodes", json={"name": "n1", "address": "127.0.0.1", "units": 1})

    job = client.submit_job({**spec, "parameters": {"epochs": 2}})
    assert isinstance(job, Job) and job.parameters["batch_size"] == 16 and not job.is_final
    assert client.get_job(job.id).id == job.id
    assert [j.id for j in client.iter_jobs()] == [job.id]

    with pytest.raises(RequestValidationError) as bad:
        client.submit_job({**spec, "parameters": {"epochs": 0, "image_size": 8}})
    assert bad.value.code == "ValidationError" and bad.value.status_code == 422
    assert {e["field"] for e in bad.value.details} == {"parameters.epochs", "parameters.image_size"}
    with pytest.raises(NotFoundError) as missing:
        client.get_job("nope")
    assert missing.value.status_code == 404
    with pytest.raises(InvalidDatasetError):
        client.upload_dataset(
            tmp_path
            / "digits"
            / "train"
            / "0"
            / next(iter(sorted(p.name for p in (train_dir / "0").iterdir())))
        )

    # wait() gives up after its timeout; cancel is idempotent and returns the job
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        client.wait(job.id, timeout=1.0)
    assert time.monotonic() - started < 10
    first = client.cancel_job(job.id).status  # "cancelling" once placed on n1: its agent must stop it
    assert first in ("cancelling", "cancelled")
    # Idempotent: no error, the same job; it may have settled to cancelled in between (the
    # reaper cancels a placement no agent claimed), never gone back.
    again = client.cancel_job(job.id)
    assert again.id == job.id and again.status in ({first, "cancelled"} if first == "cancelling" else {first})
    worker.close()


def test_connection_errors(live_server: LiveServer, settings: Settings) -> None:
    with (
        Client(f"http://127.0.0.1:{free_port()}", "x") as down,
        pytest.raises(ServiceUnreachableError) as exc,
    ):
        down.cluster()
    assert "cannot reach the torchyard API" in exc.value.message
    with Client(live_server.url, "ty_wrong") as wrong, pytest.raises(AuthenticationError):
        wrong.list_jobs()


def test_pack_directory_keeps_only_regular_files(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.png").write_bytes(b"png")
    (root / "a" / ".hidden.png").write_bytes(b"no")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("no")
    (root / "a" / "link.png").symlink_to(root / "a" / "x.png")
    (root / "b").symlink_to(root / "a")
    out = tmp_path / "ds.tar.gz"
    with open(out, "wb") as fh:
        pack_directory(root, fh)
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == ["ds", "ds/a", "ds/a/x.png"]
    assert all(m.isreg() or m.isdir() for m in members.values())
    assert all(m.uid == 0 and m.uname == "" for m in members.values())


def test_an_identical_dataset_of_the_same_name_is_reused_not_uploaded_again(
    client: Client, tmp_path: Path
) -> None:
    from torchyard.sample_data import write_digits

    train, _val = write_digits(tmp_path / "digits", per_class=3, size=8)
    first, reused = client.upload_or_reuse_dataset(train, "again")
    assert not reused
    second, reused = client.upload_or_reuse_dataset(train, "again")
    assert reused and second.id == first.id
    assert [d.id for d in client.iter_datasets() if d.name == "again"] == [first.id]
    # Other images under the same name, or the same images under another name: a new upload.
    (next(p for p in train.iterdir() if p.is_dir()) / "extra.png").write_bytes(
        next(train.glob("*/*.png")).read_bytes()
    )
    third, reused = client.upload_or_reuse_dataset(train, "again")
    assert not reused and third.id != first.id
    fourth, reused = client.upload_or_reuse_dataset(train, "other")
    assert not reused and fourth.id != third.id
