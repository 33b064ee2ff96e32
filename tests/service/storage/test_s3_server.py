"""The private S3 server of the tests (tests/support/s3_server.py) is a real S3 that does what
torchyard's object storage relies on: multipart uploads, presigned PUTs whose SHA-256 is
part of the signature, presigned ranged GETs, refused signatures, aborted uploads, and
checksums kept with objects. Control calls go through boto3; presigned requests through
httpx, as a worker or browser would send them."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError

from tests.support.s3_server import S3Server

MIB = 1024 * 1024


def sha256_b64(body: bytes) -> str:
    return base64.b64encode(hashlib.sha256(body).digest()).decode()


def error_code(response: httpx.Response) -> str:
    """The ``<Code>`` of an S3 error document."""
    text = response.text
    start = text.find("<Code>")
    end = text.find("</Code>")
    return text[start + len("<Code>") : end] if start >= 0 and end > start else text


def new_key() -> str:
    return f"k-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def server(s3_server: S3Server) -> S3Server:
    return s3_server


@pytest.fixture(scope="module")
def s3(server: S3Server) -> Any:
    return server.client()


@pytest.fixture(scope="module")
def bucket(server: S3Server) -> str:
    return server.make_bucket()


def test_multipart_upload_of_eight_5_mib_parts_reads_back_equal(s3: Any, bucket: str) -> None:
    key = new_key()
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = [os.urandom(5 * MIB) for _ in range(8)]
    etags = [
        s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body)["ETag"]
        for n, body in enumerate(parts, start=1)
    ]
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, start=1)]},
    )
    whole = b"".join(parts)
    assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == 40 * MIB
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == whole


def test_presigned_put_with_a_signed_sha256_takes_only_that_body(s3: Any, bucket: str) -> None:
    key = new_key()
    body = b"the checkpoint's bytes " * 40
    digest = sha256_b64(body)
    url = s3.generate_presigned_url(
        "put_object", Params={"Bucket": bucket, "Key": key, "ChecksumSHA256": digest}, ExpiresIn=300
    )

    changed = httpx.put(url, content=body[:-1] + b"!", headers={"x-amz-checksum-sha256": digest})
    assert changed.status_code == 400, changed.text
    assert error_code(changed) == "BadDigest"
    with pytest.raises(ClientError) as missing:
        s3.head_object(Bucket=bucket, Key=key)
    assert missing.value.response["Error"]["Code"] == "404"  # nothing half-written

    unsigned = httpx.put(url, content=body)  # the signed header left out
    assert unsigned.status_code == 403, unsigned.text

    good = httpx.put(url, content=body, headers={"x-amz-checksum-sha256": digest})
    assert good.status_code == 200, good.text
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == body


def test_presigned_upload_part_with_a_signed_sha256_takes_only_that_body(s3: Any, bucket: str) -> None:
    key = new_key()
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256")["UploadId"]
    part = os.urandom(64 * 1024)
    digest = sha256_b64(part)
    url = s3.generate_presigned_url(
        "upload_part",
        Params={
            "Bucket": bucket,
            "Key": key,
            "UploadId": upload_id,
            "PartNumber": 1,
            "ChecksumSHA256": digest,
        },
        ExpiresIn=300,
    )

    changed = httpx.put(url, content=bytes(64 * 1024), headers={"x-amz-checksum-sha256": digest})
    assert changed.status_code == 400, changed.text
    assert error_code(changed) == "BadDigest"
    assert s3.list_parts(Bucket=bucket, Key=key, UploadId=upload_id).get("Parts", []) == []

    unsigned = httpx.put(url, content=part)
    assert unsigned.status_code == 403, unsigned.text

    good = httpx.put(url, content=part, headers={"x-amz-checksum-sha256": digest})
    assert good.status_code == 200, good.text
    etag = good.headers["ETag"]
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag, "ChecksumSHA256": digest}]},
    )
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == part


def test_presigned_get_answers_a_range_and_the_asked_content_disposition(s3: Any, bucket: str) -> None:
    key = new_key()
    body = bytes(range(100))
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    disposition = 'attachment; filename="model.onnx"'
    url = s3.generate_presigned_url(
        "get_object",
        Params={"Bucket": bucket, "Key": key, "ResponseContentDisposition": disposition},
        ExpiresIn=300,
    )

    ranged = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert ranged.status_code == 206, ranged.text
    assert ranged.content == body[10:20]
    assert ranged.headers["Content-Range"] == "bytes 10-19/100"
    assert ranged.headers["Content-Disposition"] == disposition


def test_a_wrong_secret_key_is_refused(server: S3Server, bucket: str) -> None:
    wrong = server.client(secret_key=server.secret_key + "x")
    with pytest.raises(ClientError) as refused:
        wrong.list_objects_v2(Bucket=bucket)
    assert refused.value.response["Error"]["Code"] == "SignatureDoesNotMatch"


def test_an_aborted_multipart_upload_is_no_longer_listed(s3: Any, bucket: str) -> None:
    key = new_key()
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"partial")

    def listed() -> list[str]:
        uploads = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return [u["UploadId"] for u in uploads if u["Key"] == key]

    assert listed() == [upload_id]
    s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    assert listed() == []


def test_head_object_returns_the_sha256_an_object_was_put_with(s3: Any, bucket: str) -> None:
    key = new_key()
    body = b"metrics.jsonl\n" * 100
    s3.put_object(Bucket=bucket, Key=key, Body=body, ChecksumSHA256=sha256_b64(body))
    head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == sha256_b64(body)


def test_env_points_a_subprocess_s3_client_at_the_server(
    server: S3Server, bucket: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env())
    env["AWS_CONFIG_FILE"] = str(tmp_path / "none")  # no user's profile takes part
    env["AWS_SHARED_CREDENTIALS_FILE"] = str(tmp_path / "none")
    code = "import boto3; print(' '.join(b['Name'] for b in boto3.client('s3').list_buckets()['Buckets']))"
    listed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert bucket in listed.stdout.split()
