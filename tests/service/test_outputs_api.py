"""A script job's outputs archive: the caps on what an upload may unpack to (entries, bytes,
no sparse files), nothing kept on a refusal, and one file served without reading the whole
archive again."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zlib
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job
from service.services import outputs, outputs_index
from service.services.outputs import OutputsStore
from tests.service.test_script_jobs_api import upload_code
from tests.support.factories import auth
from tests.support.report_helpers import RunningJob, start_running_job
from torchyard.contract.archive import MAX_OUTPUTS_FILES, MAX_OUTPUTS_UNCOMPRESSED_BYTES
from torchyard.contract.headers import SHA256_HEADER

_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
_ZEROS_BLOCK = 16 * 1024**2


def _times(mat: list[int], vec: int) -> int:
    out = i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _crc32_zeros(crc: int, length: int) -> int:
    """``zlib.crc32(bytes(length), crc)`` without the bytes (zlib's crc32_combine)."""
    reg = crc ^ 0xFFFFFFFF
    op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        op = [_times(op, op[n]) for n in range(32)]  # squared: two, four, eight bits
    while length:
        if length & 1:
            reg = _times(op, reg)
        length >>= 1
        op = [_times(op, op[n]) for n in range(32)]
    return reg ^ 0xFFFFFFFF


def _deflated(data: bytes, flush: int = zlib.Z_FULL_FLUSH) -> bytes:
    """``data`` as a raw deflate piece that refers to nothing before it."""
    co = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return co.compress(data) + co.flush(flush)


def zeros_gzip(head: bytes, zeros: int, tail: bytes) -> bytes:
    """A valid gzip of ``head``, ``zeros`` zero bytes and ``tail``, made in milliseconds
    whatever ``zeros`` is: one deflated block of zeros repeated (each piece stands alone)."""
    block = _deflated(bytes(_ZEROS_BLOCK))
    rest = zeros % _ZEROS_BLOCK
    body = [_GZIP_HEADER, _deflated(head), block * (zeros // _ZEROS_BLOCK), _deflated(bytes(rest))]
    body.append(_deflated(tail, zlib.Z_FINISH))
    crc = zlib.crc32(tail, _crc32_zeros(zlib.crc32(head), zeros))
    size = len(head) + zeros + len(tail)
    return b"".join(body) + crc.to_bytes(4, "little") + (size & 0xFFFFFFFF).to_bytes(4, "little")


def small_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def big_zero_file_then(size: int, files: dict[str, bytes]) -> bytes:
    """A .tar.gz of ``big.bin`` (``size`` zero bytes), then ``files``; a few bytes per GiB."""
    info = tarfile.TarInfo("big.bin")
    info.size = size
    head = info.tobuf(format=tarfile.PAX_FORMAT)
    return zeros_gzip(head, size + (-size) % tarfile.BLOCKSIZE, small_tar(files))


def sparse_tar_gz(real_size: int) -> bytes:
    """A .tar.gz whose one member is a GNU sparse file of ``real_size`` bytes holding 512."""
    info = tarfile.TarInfo("sparse.bin")
    info.type = tarfile.GNUTYPE_SPARSE
    info.size = tarfile.BLOCKSIZE
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[386:398] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)  # one region: offset 0,
    header[398:410] = tarfile.itn(tarfile.BLOCKSIZE, 12, tarfile.GNU_FORMAT)  # 512 bytes
    header[483:495] = tarfile.itn(real_size, 12, tarfile.GNU_FORMAT)
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header[: tarfile.BLOCKSIZE])
    raw = bytes(header) + b"x" * tarfile.BLOCKSIZE + bytes(2 * tarfile.BLOCKSIZE)
    return zeros_gzip(raw, 0, b"")


def _script_job(settings: Settings, client: TestClient, **spec: Any) -> RunningJob:
    job = start_running_job(settings, client, node_count=2 if spec else 1, per_node=1)
    code = upload_code(client, {"train.py": b"print('hi')\n"}).json()["id"]
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            row = session.get_one(Job, job.job_id)
            values: dict[str, Any] = {"type": "script", "code_id": code}
            if spec:
                values["spec"] = {**row.spec, **spec}
            session.execute(update(Job).where(Job.id == job.job_id).values(**values))
    finally:
        db.dispose()
    return job


def _upload(client: TestClient, job: RunningJob, body: bytes, node_rank: int = 0) -> Any:
    headers = {**job.worker_headers(node_rank), SHA256_HEADER: hashlib.sha256(body).hexdigest()}
    return client.put(f"/v1/worker/jobs/{job.job_id}/outputs", content=body, headers=headers)


def _left_on_disk(settings: Settings) -> list[str]:
    root = OutputsStore(settings.data_dir).root
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
    )


def _refused_and_nothing_kept(
    client: TestClient, settings: Settings, job: RunningJob, r: Any, status: int, words: str
) -> None:
    assert r.status_code == status, r.text
    assert words in r.json()["message"], r.text
    assert _left_on_disk(settings) == []
    shown = client.get(f"/v1/jobs/{job.job_id}", headers=auth(job.user_token)).json()
    assert shown["outputs_sha256"] is None
    assert client.get(f"/v1/jobs/{job.job_id}/outputs", headers=auth(job.user_token)).status_code == 409


def test_a_small_archive_past_the_uncompressed_cap_is_refused_and_nothing_kept(
    client: TestClient, settings: Settings
) -> None:
    job = _script_job(settings, client)
    body = big_zero_file_then(MAX_OUTPUTS_UNCOMPRESSED_BYTES + 1, {})
    assert len(body) < 10 * 1024**2  # a few MB sent, more than 8 GiB once unpacked
    r = _upload(client, job, body)
    _refused_and_nothing_kept(client, settings, job, r, 413, "expands to more than")
    assert r.json()["code"] == "PayloadTooLargeError"


def test_an_archive_past_the_entry_cap_is_refused_and_nothing_kept(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert MAX_OUTPUTS_FILES == 100_000
    monkeypatch.setattr(outputs, "MAX_OUTPUTS_FILES", 50)  # the rule, without 100,001 headers to write
    job = _script_job(settings, client)
    body = zeros_gzip(small_tar({f"f/{i}.txt": b"" for i in range(51)}), 0, b"")
    r = _upload(client, job, body)
    _refused_and_nothing_kept(client, settings, job, r, 413, "more than 50 entries")
    ok = _upload(client, job, zeros_gzip(small_tar({f"f/{i}.txt": b"" for i in range(50)}), 0, b""))
    assert ok.status_code == 200 and ok.json()["files"] == 50, ok.text


def test_a_sparse_member_is_refused(client: TestClient, settings: Settings) -> None:
    """A sparse file unpacks to what it declares (here 4 GiB) from a few bytes."""
    job = _script_job(settings, client)
    r = _upload(client, job, sparse_tar_gz(4 * 1024**3))
    _refused_and_nothing_kept(client, settings, job, r, 422, "is not a file or folder")


def test_files_are_served_without_reading_the_whole_archive_again(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {f"run/{i}.txt": f"file {i}\n".encode() * (i + 1) for i in range(20)}
    big = 4 * outputs_index.SPACING  # 128 MiB of zeros before them
    job = _script_job(settings, client)
    body = big_zero_file_then(big, files)
    r = _upload(client, job, body)
    assert r.status_code == 200 and r.json()["files"] == 21, r.text
    user = auth(job.user_token)

    built: list[Path] = []
    real_build = outputs_index.build_index
    monkeypatch.setattr(outputs_index, "build_index", lambda path: built.append(path) or real_build(path))
    filled = [0]
    real_fill = outputs_index._Inflater._fill

    def counting_fill(self: Any) -> bool:
        filled[0] += 1
        return real_fill(self)

    monkeypatch.setattr(outputs_index._Inflater, "_fill", counting_fill)
    url = f"/v1/jobs/{job.job_id}/outputs"
    for name, data in files.items():
        filled[0] = 0
        one = client.get(url, params={"path": name}, headers=user)
        assert one.status_code == 200 and one.content == data, (name, one.text)
        assert one.headers["etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
        if built and name != "run/0.txt":
            # From the access point before it: at most SPACING bytes decompressed (1 MiB a fill).
            assert filled[0] <= outputs_index.SPACING // (1024 * 1024) + 4, (name, filled[0])
    assert len(built) == 1  # the whole archive was read once, for the first file
    again = client.get(url, params={"path": "run/3.txt"}, headers=user)
    assert again.content == files["run/3.txt"]
    missing = client.get(url, params={"path": "run/nope.txt"}, headers=user)
    assert missing.status_code == 404, missing.text
    whole = client.get(url, headers=user)
    assert (
        whole.status_code == 200
        and hashlib.sha256(whole.content).hexdigest() == hashlib.sha256(body).hexdigest()
    )
    assert len(built) == 1


def test_a_stored_archive_past_the_caps_has_no_files_served(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archive stored before the caps is downloaded whole; its files are not unpacked."""
    job = _script_job(settings, client)
    files = {f"{i}.txt": b"x" * 100 for i in range(10)}
    assert _upload(client, job, zeros_gzip(small_tar(files), 0, b"")).status_code == 200
    real_build = outputs_index.build_index
    monkeypatch.setattr(outputs_index, "build_index", lambda path: real_build(path, max_bytes=500))
    r = client.get(f"/v1/jobs/{job.job_id}/outputs", params={"path": "9.txt"}, headers=auth(job.user_token))
    assert r.status_code == 413 and "download it whole" in r.json()["message"], r.text
    assert not OutputsStore(settings.data_dir).files_dir(job.job_id).exists()


def test_every_nodes_outputs_together_stay_within_the_caps(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outputs, "MAX_OUTPUTS_FILES", 8)
    job = _script_job(settings, client, outputs="all")
    first = zeros_gzip(small_tar({f"{i}.txt": b"0" for i in range(4)}), 0, b"")
    assert _upload(client, job, first, node_rank=0).status_code == 200  # node-0/ and 4 files
    kept = _left_on_disk(settings)
    second = zeros_gzip(small_tar({f"{i}.txt": b"1" for i in range(3)}), 0, b"")
    r = _upload(client, job, second, node_rank=1)  # node-1/ and 3 more: 9 entries
    assert r.status_code == 413 and "more than 8 entries" in r.json()["message"], r.text
    assert _left_on_disk(settings) == kept
    fits = zeros_gzip(small_tar({f"{i}.txt": b"1" for i in range(2)}), 0, b"")
    assert _upload(client, job, fits, node_rank=1).status_code == 200
