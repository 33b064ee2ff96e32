"""File downloads over HTTP: ``ETag``, a single ``Range`` (resume), ``If-Range`` and
``If-None-Match``, streamed from disk in chunks read off the event loop."""

from __future__ import annotations

import os
from typing import Any, BinaryIO

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.services.artifacts import ModelFile
from service.services.checkpoints import CheckpointFile
from service.services.incoming import IncomingUpload
from service.services.stored_archives import StoredFile
from service.storage.base import ObjectStorage, StorageError, attachment
from torchyard.contract.errors import PayloadTooLargeError, ServiceUnavailableError

# What a download serves: a model, a checkpoint, or an input's stored archive.
Served = ModelFile | CheckpointFile | StoredFile

_READ_CHUNK = 256 * 1024
_WRITE_CHUNK = 1 << 20


def refuse_oversized(request: Request, limit: int, what: str) -> None:
    """413 before reading a body whose declared length is over ``limit``."""
    length = request.headers.get("content-length", "")
    # ASCII digits only: "²" is a digit to isdigit() that int() refuses.
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"{what} exceeds the limit of {limit} bytes")


async def receive_body(request: Request, incoming: IncomingUpload) -> str:
    """Stream an upload's body into ``incoming`` (1 MiB writes, off the event loop); its sha256."""
    buffer = bytearray()
    async for chunk in request.stream():
        buffer += chunk
        if len(buffer) >= _WRITE_CHUNK:
            await run_in_threadpool(incoming.write, bytes(buffer))
            buffer.clear()
    await run_in_threadpool(incoming.write, bytes(buffer))
    actual: str = await run_in_threadpool(incoming.finish)
    return actual


class _Unsatisfiable(Exception):
    pass


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive byte range of a single-range ``Range`` header, or None to send it all.

    Headers this server does not honour (other units, several ranges, malformed) are
    ignored as RFC 9110 allows; a range starting past the end raises ``_Unsatisfiable``.
    """
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = (part.strip() for part in spec.partition("-"))
    # ASCII digits only: "²" is a digit that int() refuses, "١" a decimal it takes.
    if (
        not dash
        or not (first or last)
        or (first and not (first.isascii() and first.isdigit()))
        or (last and not (last.isascii() and last.isdigit()))
    ):
        return None
    if not first:  # the last N bytes
        length = int(last)
        if length == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - length), size - 1
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise _Unsatisfiable
    return start, min(int(last), size - 1) if last else size - 1


def _etags(header: str) -> list[str]:
    return [tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()]


async def _file_chunks(fh: BinaryIO, start: int, length: int) -> Any:
    try:
        position, remaining = start, length
        while remaining > 0:
            chunk = await anyio.to_thread.run_sync(
                os.pread, fh.fileno(), min(_READ_CHUNK, remaining), position
            )
            if not chunk:
                break
            position += len(chunk)
            remaining -= len(chunk)
            yield chunk
    finally:
        fh.close()


def object_response(
    request: Request,
    storage: ObjectStorage,
    key: str,
    served: Served,
    *,
    ttl_s: int,
    media_type: str = "application/gzip",
    extra_headers: dict[str, str] | None = None,
) -> Response:
    """An artifact's download: the bytes from disk (file storage, :func:`file_response`), or
    a redirect to a presigned URL of the object (object storage: the client's GET, its
    ``Range`` included, goes to the store). ``ETag``, ``If-None-Match`` and the kind's own
    headers are the API's either way; a HEAD is answered here without the store."""
    if not storage.direct:
        return file_response(request, served, media_type=media_type, extra_headers=extra_headers)
    headers = _headers(served, extra_headers)
    if _not_modified(request, headers["ETag"]):
        return Response(status_code=304, headers=headers)
    if request.method == "HEAD":
        headers["Content-Length"] = str(served.size)
        return Response(status_code=200, headers=headers, media_type=media_type)
    try:
        url = storage.download_url(key, filename=served.filename, content_type=media_type, ttl_s=ttl_s)
    except StorageError as exc:
        raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc
    headers.pop("Accept-Ranges")
    return RedirectResponse(url, status_code=307, headers=headers)


def _headers(served: Served, extra_headers: dict[str, str] | None) -> dict[str, str]:
    return {
        "ETag": f'"{served.sha256}"',
        "Accept-Ranges": "bytes",
        "Content-Disposition": attachment(served.filename),
        "Cache-Control": "private, no-cache",
        **(extra_headers or {}),
    }


def _not_modified(request: Request, etag: str) -> bool:
    if_none_match = request.headers.get("if-none-match")
    return if_none_match is not None and any(tag in (etag, "*") for tag in _etags(if_none_match))


def file_response(
    request: Request,
    model: Served,
    *,
    media_type: str = "application/gzip",
    extra_headers: dict[str, str] | None = None,
) -> Response:
    headers = _headers(model, extra_headers)
    etag = headers["ETag"]
    if _not_modified(request, etag):
        return Response(status_code=304, headers=headers)
    assert model.path is not None, "a file download of an object that is not a file"
    fh = open(model.path, "rb")  # noqa: SIM115 - closed by the body iterator
    try:
        size = os.fstat(fh.fileno()).st_size
        if_range = request.headers.get("if-range")
        byte_range = None
        if if_range is None or if_range.strip() == etag:
            byte_range = parse_range(request.headers.get("range"), size)
    except _Unsatisfiable:
        fh.close()
        return JSONResponse(
            {"code": "RangeNotSatisfiableError", "message": f"the archive has {size} bytes"},
            status_code=416,
            headers={**headers, "Content-Range": f"bytes */{size}"},
        )
    except BaseException:
        fh.close()
        raise
    status = 200
    start, length = 0, size
    if byte_range is not None:
        status = 206
        start, length = byte_range[0], byte_range[1] - byte_range[0] + 1
        headers["Content-Range"] = f"bytes {byte_range[0]}-{byte_range[1]}/{size}"
    headers["Content-Length"] = str(length)
    if request.method == "HEAD":
        fh.close()
        return Response(status_code=status, headers=headers, media_type=media_type)
    return StreamingResponse(
        _file_chunks(fh, start, length), status_code=status, headers=headers, media_type=media_type
    )
