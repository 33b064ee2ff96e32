"""The dataset routes' request bodies, streamed to disk with a hard size limit.

A multipart body is parsed as it arrives: the file part goes straight to a file (in
chunks of at most 1 MiB held in memory), small text fields are kept, and the body is
refused with 413 as soon as it passes the limit — the declared Content-Length is
checked before anything is read, the bytes actually received while reading.
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from service.api.errors import malformed_json_message, surrogate_field, surrogate_message
from torchyard.contract.errors import PayloadTooLargeError, RequestValidationError, TorchyardError

_FLUSH_BYTES = 1024 * 1024
# Room for the multipart framing and the small text fields around the file.
MULTIPART_OVERHEAD = 64 * 1024
_MAX_FIELD_BYTES = 4096
_MAX_PARTS = 16


def check_content_length(request: Request, limit: int) -> None:
    """413 at once when the declared body size is over ``limit``; 422 when it is not a number."""
    declared = request.headers.get("content-length")
    if declared is None:
        return
    try:
        size = int(declared)
    except ValueError:
        raise RequestValidationError("Content-Length is not a number") from None
    if size > limit:
        raise PayloadTooLargeError(
            f"the request body is {size} bytes, more than the limit of {limit} bytes",
            details={"limit": limit},
        )


@dataclass
class ReceivedForm:
    """The text fields of a multipart body and where its file part was written."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file_bytes: int = 0
    has_file: bool = False


@dataclass
class _Part:
    headers: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    filename: str | None = None
    is_file: bool = False
    data: bytearray = field(default_factory=bytearray)


class _FormState:
    """The parser's callbacks: they only collect; the caller writes to disk between chunks."""

    def __init__(self, file_field: str, text_fields: frozenset[str]) -> None:
        self.file_field = file_field
        self.text_fields = text_fields
        self.form = ReceivedForm()
        self.part = _Part()
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.pending = bytearray()  # file bytes received but not yet written
        self.parts = 0
        self.ended = False

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > _MAX_PARTS:
            raise RequestValidationError(f"the multipart body has more than {_MAX_PARTS} parts")
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]
        if len(self.header_value) > _MAX_FIELD_BYTES:
            raise RequestValidationError("a multipart part header is too long")

    def on_header_end(self) -> None:
        key = self.header_field.decode("latin-1").lower()
        self.part.headers[key] = self.header_value.decode("latin-1")
        self.header_field.clear()
        self.header_value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.part.headers.get("content-disposition", ""))
        name = options.get(b"name")
        if name is None:
            raise RequestValidationError("a multipart part has no name")
        self.part.name = name.decode("utf-8", "replace")
        filename = options.get(b"filename")
        if self.part.name == self.file_field:
            if self.form.has_file:
                raise RequestValidationError(f"more than one {self.file_field!r} part")
            self.part.is_file = True
            self.form.has_file = True
            self.form.filename = filename.decode("utf-8", "replace") if filename is not None else None
        elif self.part.name not in self.text_fields:
            allowed = ", ".join(sorted({self.file_field, *self.text_fields}))
            raise RequestValidationError(f"unknown field {self.part.name!r} (allowed: {allowed})")
        elif self.part.name in self.form.fields:
            raise RequestValidationError(f"field {self.part.name!r} is given more than once")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.part.is_file:
            self.form.file_bytes += end - start
            self.pending += data[start:end]
            return
        self.part.data += data[start:end]
        if len(self.part.data) > _MAX_FIELD_BYTES:
            raise RequestValidationError(f"field {self.part.name!r} is longer than {_MAX_FIELD_BYTES} bytes")

    def on_part_end(self) -> None:
        if not self.part.is_file and self.part.name is not None:
            try:
                self.form.fields[self.part.name] = self.part.data.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestValidationError(f"field {self.part.name!r} is not UTF-8 text") from None

    def on_end(self) -> None:
        self.ended = True


async def receive_multipart(
    request: Request,
    dest: Path,
    *,
    max_file_bytes: int,
    file_field: str = "file",
    text_fields: frozenset[str] = frozenset(),
) -> ReceivedForm:
    """Parse a ``multipart/form-data`` body as it streams in, writing the file part to ``dest``.

    Raises PayloadTooLargeError (413) when the file passes ``max_file_bytes`` (or the
    whole body passes it plus a small allowance), RequestValidationError (422) for a
    malformed body or unknown fields. ``dest`` is removed on any error.
    """
    max_body = max_file_bytes + MULTIPART_OVERHEAD
    check_content_length(request, max_body)
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise RequestValidationError("multipart body without a boundary in its Content-Type")
    state = _FormState(file_field, text_fields)
    callbacks: Any = {
        name: getattr(state, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
            "on_part_data",
            "on_part_end",
            "on_end",
        )
    }
    parser = MultipartParser(boundary, callbacks)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    out = os.fdopen(fd, "wb")
    received = 0
    too_large = PayloadTooLargeError(
        f"the upload is larger than the limit of {max_file_bytes} bytes", details={"limit": max_file_bytes}
    )
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > max_body:
                raise too_large
            try:
                parser.write(chunk)
            except FormParserError as exc:
                raise RequestValidationError(f"malformed multipart body: {exc}") from None
            if state.form.file_bytes > max_file_bytes:
                raise too_large
            if len(state.pending) >= _FLUSH_BYTES:
                data = bytes(state.pending)
                state.pending.clear()
                await run_in_threadpool(out.write, data)
        if state.pending:
            await run_in_threadpool(out.write, bytes(state.pending))
            state.pending.clear()
        if not state.ended:
            raise RequestValidationError("the multipart body ended early (no closing boundary)")
        await run_in_threadpool(out.close)
    except BaseException:
        out.close()
        dest.unlink(missing_ok=True)
        raise
    return state.form


async def receive_json(request: Request, max_bytes: int = 64 * 1024) -> Any:
    """A small JSON body, read with a size limit."""
    check_content_length(request, max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise PayloadTooLargeError(f"the JSON body is larger than {max_bytes} bytes")
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError(malformed_json_message(exc.msg, exc.doc, exc.pos)) from None
    except ValueError as exc:  # not UTF-8
        raise RequestValidationError(f"the JSON body is not UTF-8 text: {exc}") from None
    found = surrogate_field(value)
    if found is not None:
        raise RequestValidationError(surrogate_message(*found), details={"field": found[0]})
    return value


@dataclass
class FileUpload:
    """A multipart upload received into its own workspace: the workspace, the file, the form."""

    work: Path
    path: Path
    form: ReceivedForm


async def receive_file_upload(
    request: Request,
    stack: ExitStack,
    workspace: AbstractContextManager[Path],
    *,
    max_file_bytes: int,
    text_fields: frozenset[str],
) -> FileUpload | JSONResponse:
    """Receive a multipart body with a ``file`` part into ``workspace`` (entered on ``stack``,
    so it lasts as long as the caller's block). A refusal while the body arrives (413, 409
    for too many uploads at once, 422) is the answer to send, closing the connection: the
    rest of the body is not wanted, rather than drained. 422 when no ``file`` part came."""
    try:
        work = stack.enter_context(workspace)
        dest = work / "upload.part"
        form = await receive_multipart(request, dest, max_file_bytes=max_file_bytes, text_fields=text_fields)
    except TorchyardError as exc:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers={"Connection": "close"})
    if not form.has_file:
        raise RequestValidationError("the multipart body has no 'file' part", details={"field": "file"})
    return FileUpload(work, dest, form)
