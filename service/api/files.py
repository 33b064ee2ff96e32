"""File downloads over HTTP: ``ETag``, a single ``Range`` (resume), ``If-Range`` and
``If-None-Match``, streamed from disk in chunks read off the event loop."""

from __future__ import annotations

import os
import re
from typing import Any, BinaryIO
from urllib.parse import quote

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.services.artifacts import ModelFile
from service.services.checkpoints import CheckpointFile
from service.services.incoming import IncomingUpload
from torchyard.contract.errors import PayloadTooLargeError

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


def _content_disposition(filename: str) -> str:
    ascii_name = re.sub(r"[^A-Za-z0-9._-]+", "_", filename)
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"


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


def file_response(
    request: Request,
    model: ModelFile | CheckpointFile,
    *,
    media_type: str = "application/gzip",
    extra_headers: dict[str, str] | None = None,
) -> Response:
    etag = f'"{model.sha256}"'
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Content-Disposition": _content_disposition(model.filename),
        "Cache-Control": "private, no-cache",
        **(extra_headers or {}),
    }
    if_none_match = request.headers.get("if-none-match")
    if if_none_match is not None and any(tag in (etag, "*") for tag in _etags(if_none_match)):
        return Response(status_code=304, headers=headers)
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
