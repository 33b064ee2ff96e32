"""Objects in an S3 bucket (``TORCHYARD_STORAGE_URL=s3://bucket/prefix``), with boto3.

The endpoint, region and credentials come from the standard AWS settings (``AWS_ENDPOINT_URL``
or ``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, the shared config files, an instance role...): boto3 reads them. The
service never hands credentials out: clients get presigned URLs for one object each, valid
for ``TORCHYARD_STORAGE_URL_TTL_S`` seconds.

Every presigned PUT signs ``x-amz-checksum-sha256``: the store computes the sha256 of the
bytes it receives and refuses them (400 BadDigest) unless they hash to the signed value,
and a request without that exact header does not match its signature (403).
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from service.storage.base import (
    ObjectInfo,
    PartTarget,
    StorageError,
    UploadIncomplete,
    UploadTargets,
    attachment,
)
from service.storage.files import check_key
from torchyard.contract.transfer import part_sizes

_CHECKSUM_HEADER = "x-amz-checksum-sha256"
_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchUpload"}


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as (bucket, prefix with a trailing slash, or empty)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"TORCHYARD_STORAGE_URL must be s3://bucket[/prefix], not {url!r}")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def b64_sha256(hex_digest: str) -> str:
    """The base64 form of a hex sha256, as S3's checksum headers carry it."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode("ascii")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Storage:
    direct = True

    def __init__(self, url: str, *, client: Any = None) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.description = f"s3://{self.bucket}/{self.prefix}"
        if client is None:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            config = Config(
                signature_version="s3v4",
                s3={"addressing_style": "path" if endpoint else "auto"},
                retries={"mode": "standard", "max_attempts": 5},
            )
            client = boto3.session.Session().client("s3", config=config)
        self.client = client

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key).as_posix()

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            raise StorageError(f"{what} in {self.description}: {_code(exc) or exc}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"{what} in {self.description}: {exc}") from exc

    def local_path(self, key: str) -> Path | None:
        return None

    def put_file(self, key: str, source: Path) -> None:
        try:
            self.client.upload_file(
                str(source),
                self.bucket,
                self._key(key),
                Config=TransferConfig(multipart_threshold=64 * 1024**2, multipart_chunksize=64 * 1024**2),
                ExtraArgs={"ChecksumAlgorithm": "SHA256"},
            )
        except (ClientError, BotoCoreError, Boto3Error) as exc:
            raise StorageError(f"upload of {key} to {self.description}: {exc}") from exc

    def adopt_file(self, key: str, source: Path) -> None:
        self.put_file(key, source)
        Path(source).unlink(missing_ok=True)

    def get_file(self, key: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        os.close(fd)
        try:
            self.client.download_file(self.bucket, self._key(key), tmp)
            os.replace(tmp, dest)
        except (ClientError, BotoCoreError, Boto3Error) as exc:
            raise StorageError(f"download of {key} from {self.description}: {exc}") from exc
        finally:
            Path(tmp).unlink(missing_ok=True)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            found = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return None
            raise StorageError(f"HEAD {key} in {self.description}: {_code(exc) or exc}") from exc
        return ObjectInfo(key, int(found["ContentLength"]), found.get("LastModified"))

    def delete(self, key: str) -> None:
        self._call(f"delete of {key}", self.client.delete_object, Key=self._key(key))

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        try:
            for page in pages:
                for item in page.get("Contents", []):
                    key = str(item["Key"])[len(self.prefix) :]
                    yield ObjectInfo(key, int(item["Size"]), item.get("LastModified"))
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"listing {prefix} in {self.description}: {exc}") from exc

    def delete_prefix(self, prefix: str) -> int:
        keys = [info.key for info in self.list_objects(prefix)]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            self._call(
                f"delete under {prefix}", self.client.delete_objects, Delete={"Objects": batch, "Quiet": True}
            )
        return len(keys)

    def download_url(self, key: str, *, filename: str, content_type: str, ttl_s: int) -> str:
        params = {
            "Bucket": self.bucket,
            "Key": self._key(key),
            "ResponseContentDisposition": attachment(filename),
            "ResponseContentType": content_type,
        }
        return str(self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=ttl_s))

    def _part_targets(
        self, key: str, upload_id: str | None, size: int, part_bytes: int, part_sha256: list[str], ttl_s: int
    ) -> list[PartTarget]:
        sizes = part_sizes(size, part_bytes)
        if len(sizes) != len(part_sha256):
            raise UploadIncomplete(f"{len(part_sha256)} part checksums for {len(sizes)} parts")
        targets = []
        for number, (part_size, digest) in enumerate(zip(sizes, part_sha256, strict=True), start=1):
            checksum = b64_sha256(digest)
            params: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": self._key(key),
                "ChecksumSHA256": checksum,
            }
            if upload_id is None:
                url = self.client.generate_presigned_url("put_object", Params=params, ExpiresIn=ttl_s)
            else:
                params.update(UploadId=upload_id, PartNumber=number)
                url = self.client.generate_presigned_url("upload_part", Params=params, ExpiresIn=ttl_s)
            headers = {_CHECKSUM_HEADER: checksum, "Content-Length": str(part_size)}
            targets.append(PartTarget(number, str(url), headers, part_size))
        return targets

    def begin_upload(
        self, key: str, *, sha256: str, size: int, part_bytes: int, part_sha256: list[str], ttl_s: int
    ) -> UploadTargets:
        upload_id = None
        if len(part_sha256) > 1:
            started = self._call(
                f"multipart upload of {key}",
                self.client.create_multipart_upload,
                Key=self._key(key),
                ChecksumAlgorithm="SHA256",
            )
            upload_id = str(started["UploadId"])
        return UploadTargets(
            upload_id, self._part_targets(key, upload_id, size, part_bytes, part_sha256, ttl_s)
        )

    def _received(self, key: str, upload_id: str) -> dict[int, dict[str, Any]]:
        received: dict[int, dict[str, Any]] = {}
        marker = 0
        while True:
            page = self._call(
                f"parts of {key}",
                self.client.list_parts,
                Key=self._key(key),
                UploadId=upload_id,
                PartNumberMarker=marker,
            )
            for part in page.get("Parts", []):
                received[int(part["PartNumber"])] = part
            if not page.get("IsTruncated"):
                return received
            marker = int(page["NextPartNumberMarker"])

    def resume_upload(
        self,
        key: str,
        upload_id: str | None,
        *,
        sha256: str,
        size: int,
        part_bytes: int,
        part_sha256: list[str],
        ttl_s: int,
    ) -> UploadTargets:
        targets = self._part_targets(key, upload_id, size, part_bytes, part_sha256, ttl_s)
        if upload_id is None:
            done = [1] if self._verified_single(key, sha256, size) else []
        else:
            received = self._received(key, upload_id)
            done = [t.number for t in targets if int(received.get(t.number, {}).get("Size", -1)) == t.size]
        return UploadTargets(upload_id, targets, done)

    def _verified_single(self, key: str, sha256: str, size: int) -> bool:
        try:
            found = self.client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return False
            raise StorageError(f"HEAD {key} in {self.description}: {_code(exc) or exc}") from exc
        return int(found["ContentLength"]) == size and found.get("ChecksumSHA256") == b64_sha256(sha256)

    def finish_upload(
        self,
        key: str,
        upload_id: str | None,
        *,
        sha256: str,
        size: int,
        part_bytes: int,
        part_sha256: list[str],
    ) -> None:
        if upload_id is None:
            if not self._verified_single(key, sha256, size):
                raise UploadIncomplete(
                    f"the object has not arrived as announced ({size} bytes with sha256 {sha256})"
                )
            return
        sizes = part_sizes(size, part_bytes)
        received = self._received(key, upload_id)
        missing = [n for n, s in enumerate(sizes, start=1) if int(received.get(n, {}).get("Size", -1)) != s]
        if missing:
            raise UploadIncomplete(f"parts {missing[:10]} of {len(sizes)} have not arrived (or not whole)")
        parts = [
            {"PartNumber": n, "ETag": received[n]["ETag"], "ChecksumSHA256": b64_sha256(part_sha256[n - 1])}
            for n in range(1, len(sizes) + 1)
        ]
        self._call(
            f"completing the upload of {key}",
            self.client.complete_multipart_upload,
            Key=self._key(key),
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
        found = self.head(key)
        if found is None or found.size != size:
            self.delete(key)
            raise UploadIncomplete(f"the object is {found.size if found else 0} bytes, not {size}")

    def holds(self, key: str, *, sha256: str, size: int, part_bytes: int, part_sha256: list[str]) -> bool:
        if len(part_sha256) <= 1:
            return self._verified_single(key, sha256, size)
        try:
            found = self.client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return False
            raise StorageError(f"HEAD {key} in {self.description}: {_code(exc) or exc}") from exc
        parts = b"".join(bytes.fromhex(d) for d in part_sha256)
        composite = f"{b64_sha256(hashlib.sha256(parts).hexdigest())}-{len(part_sha256)}"
        return int(found["ContentLength"]) == size and found.get("ChecksumSHA256") == composite

    def abort_upload(self, key: str, upload_id: str | None) -> None:
        if upload_id is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)
            except ClientError as exc:
                if _code(exc) not in _NOT_FOUND:
                    raise StorageError(f"aborting the upload of {key}: {_code(exc) or exc}") from exc
        self.delete(key)

    def abandoned_uploads(self, prefix: str, older_than: datetime) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        try:
            for page in pages:
                for upload in page.get("Uploads", []):
                    initiated = upload.get("Initiated")
                    if initiated is not None and initiated < older_than:
                        found.append((str(upload["Key"])[len(self.prefix) :], str(upload["UploadId"])))
        except (ClientError, BotoCoreError) as exc:
            raise StorageError(f"listing uploads in {self.description}: {exc}") from exc
        return found
