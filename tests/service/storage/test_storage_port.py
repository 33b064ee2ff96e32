"""The storage port (service/storage): the same behaviour from files and from a real S3
server (SeaweedFS), and what only the object store does: presigned parts whose sha256 it
verifies, resumable multipart uploads, abandoned uploads found and dropped."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.db.types import utcnow
from service.storage import FileStorage
from service.storage.base import ObjectStorage, StorageError, UploadIncomplete, UploadTargets
from service.storage.s3 import S3Storage
from torchyard.contract.transfer import MIN_PART_BYTES, describe_file


@pytest.fixture(scope="module")
def bucket(s3_server: Any) -> str:
    name: str = s3_server.make_bucket()
    return name


@pytest.fixture(scope="module")
def s3(s3_server: Any, bucket: str) -> S3Storage:
    return S3Storage(f"s3://{bucket}/port-tests", client=s3_server.client())


@pytest.fixture(params=["files", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStorage]:
    if request.param == "files":
        yield FileStorage(tmp_path / "data")
    else:
        store: S3Storage = request.getfixturevalue("s3")
        yield store
        store.delete_prefix("")


def _file(tmp_path: Path, name: str, size: int) -> Path:
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path


def test_put_get_head_list_delete_behave_the_same(storage: ObjectStorage, tmp_path: Path) -> None:
    source = _file(tmp_path, "a.bin", 3000)
    storage.put_file("models/j1.tar.gz", source)
    storage.put_file("models/j2/u1.tar.gz", source)
    info = storage.head("models/j1.tar.gz")
    assert info is not None and info.size == 3000
    assert storage.head("models/none.tar.gz") is None
    assert source.exists(), "put_file leaves its source"
    out = tmp_path / "out" / "copy.bin"
    storage.get_file("models/j2/u1.tar.gz", out)
    assert out.read_bytes() == source.read_bytes()
    assert sorted(i.key for i in storage.list_objects("models/")) == [
        "models/j1.tar.gz",
        "models/j2/u1.tar.gz",
    ]
    assert storage.delete_prefix("models/j2/") == 1
    assert [i.key for i in storage.list_objects("models/")] == ["models/j1.tar.gz"]
    storage.delete("models/j1.tar.gz")
    storage.delete("models/j1.tar.gz")  # twice: nothing to delete is no error
    assert list(storage.list_objects("models/")) == []
    moved = _file(tmp_path, "b.bin", 10)
    storage.adopt_file("weights/x.pth", moved)
    assert not moved.exists() and storage.head("weights/x.pth") is not None


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", ""])
def test_keys_outside_the_store_are_refused(storage: ObjectStorage, tmp_path: Path, key: str) -> None:
    with pytest.raises(StorageError, match="invalid object key"):
        storage.put_file(key, _file(tmp_path, "c.bin", 1))


def test_file_storage_has_no_presigned_urls(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path)
    assert storage.direct is False
    with pytest.raises(StorageError, match="the API moves the bytes"):
        storage.download_url("k", filename="k", content_type="application/gzip", ttl_s=60)


def _send(
    targets: UploadTargets, path: Path, *, skip: set[int] = frozenset(), corrupt: int | None = None
) -> list[int]:  # type: ignore[assignment]
    statuses = []
    data = path.read_bytes()
    offset = 0
    for part in targets.parts:
        body = data[offset : offset + part.size]
        offset += part.size
        if part.number in skip:
            continue
        if part.number == corrupt:
            body = b"x" + body[1:]
        statuses.append(httpx.put(part.url, content=body, headers=part.headers).status_code)
    return statuses


def test_a_single_part_upload_is_verified_by_the_store(s3: S3Storage, tmp_path: Path) -> None:
    path = _file(tmp_path, "one.bin", 100_000)
    request = describe_file(path)
    plan = dict(
        sha256=request.sha256,
        size=request.size,
        part_bytes=request.part_bytes,
        part_sha256=request.part_sha256,
    )
    targets = s3.begin_upload("checkpoints/j/one.pt", ttl_s=300, **plan)
    assert targets.upload_id is None and len(targets.parts) == 1
    # Other bytes than the signed sha256: the store refuses them, and nothing is there.
    assert _send(targets, path, corrupt=1) == [400]
    with pytest.raises(UploadIncomplete):
        s3.finish_upload("checkpoints/j/one.pt", None, **plan)
    assert s3.resume_upload("checkpoints/j/one.pt", None, ttl_s=300, **plan).done == []
    assert _send(targets, path) == [200]
    assert s3.resume_upload("checkpoints/j/one.pt", None, ttl_s=300, **plan).done == [1]
    s3.finish_upload("checkpoints/j/one.pt", None, **plan)
    url = s3.download_url(
        "checkpoints/j/one.pt", filename="ckpt é.pt", content_type="application/octet-stream", ttl_s=60
    )
    got = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert got.status_code == 206 and got.content == path.read_bytes()[10:20]
    assert "ckpt" in got.headers["content-disposition"]


def test_a_multipart_upload_resumes_and_completes_verified(s3: S3Storage, tmp_path: Path) -> None:
    path = _file(tmp_path, "big.bin", 2 * MIN_PART_BYTES + 12345)
    request = describe_file(path, MIN_PART_BYTES)
    assert len(request.part_sha256) == 3
    plan = dict(
        sha256=request.sha256,
        size=request.size,
        part_bytes=request.part_bytes,
        part_sha256=request.part_sha256,
    )
    key = "outputs/j/big.tar.gz"
    targets = s3.begin_upload(key, ttl_s=300, **plan)
    assert targets.upload_id is not None
    # Part 2 altered on the way: refused; part 3 not sent (the connection broke).
    assert _send(targets, path, skip={3}, corrupt=2) == [200, 400]
    with pytest.raises(UploadIncomplete, match=r"parts \[2, 3\]"):
        s3.finish_upload(key, targets.upload_id, **plan)
    resumed = s3.resume_upload(key, targets.upload_id, ttl_s=300, **plan)
    assert resumed.done == [1]
    assert _send(resumed, path, skip=set(resumed.done)) == [200, 200]
    s3.finish_upload(key, targets.upload_id, **plan)
    out = tmp_path / "back.bin"
    s3.get_file(key, out)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == request.sha256


def test_abandoned_uploads_are_listed_then_dropped(s3: S3Storage, tmp_path: Path) -> None:
    path = _file(tmp_path, "left.bin", MIN_PART_BYTES + 10)
    request = describe_file(path, MIN_PART_BYTES)
    plan = dict(
        sha256=request.sha256,
        size=request.size,
        part_bytes=request.part_bytes,
        part_sha256=request.part_sha256,
    )
    targets = s3.begin_upload("models/j/left.tar.gz", ttl_s=300, **plan)
    assert _send(targets, path, skip={2}) == [200]
    assert s3.abandoned_uploads("models/", utcnow() - timedelta(hours=1)) == []
    found = s3.abandoned_uploads("models/", utcnow() + timedelta(minutes=5))
    assert ("models/j/left.tar.gz", targets.upload_id) in found
    s3.abort_upload("models/j/left.tar.gz", targets.upload_id)
    assert ("models/j/left.tar.gz", targets.upload_id) not in s3.abandoned_uploads(
        "models/", utcnow() + timedelta(minutes=5)
    )
    assert s3.head("models/j/left.tar.gz") is None


def test_a_wrong_secret_is_a_storage_error(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key="wrong",
        region_name="us-east-1",
    )
    store = S3Storage(f"s3://{bucket}/x", client=client)
    with pytest.raises(StorageError, match="SignatureDoesNotMatch"):
        store.put_file("a/b", _file(tmp_path, "d.bin", 5))
