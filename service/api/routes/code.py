"""Code package routes (docs/script-jobs.md): upload, list, show, delete; and the worker's download."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import CurrentUser, ReadSessionDep, SessionDep, SettingsDep, WorkerDep
from service.api.files import object_response
from service.api.routes.dataset_bodies import receive_file_upload
from service.api.routes.datasets import default_archive_name
from service.api.routing import SessionScopedRoute
from service.schemas.code import NAME_MAX, CodeList, CodeUploadRequest
from service.services import code as code_service
from service.services import direct_uploads
from service.services.stored_archives import archive_suffix, stored_file
from torchyard.contract.errors import RequestValidationError
from torchyard.contract.headers import CONTENT_BYTES_HEADER, FILES_HEADER, SHA256_HEADER
from torchyard.contract.responses import CodePublic
from torchyard.contract.transfer import UploadPlan

router = APIRouter(tags=["code"], route_class=SessionScopedRoute)

_CREATE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "name": {
                            "type": "string",
                            "maxLength": NAME_MAX,
                            "description": "Package name (default: the file name).",
                        },
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": ".zip, .tar, .tar.gz/.tgz, .tar.bz2 or .tar.xz archive of a "
                            "source folder (its files at the top of the archive).",
                        },
                    },
                }
            }
        },
    }
}


@router.post(
    "/v1/code",
    status_code=status.HTTP_201_CREATED,
    response_model=CodePublic,
    openapi_extra=_CREATE_BODY,
    responses={413: {"description": "The upload is larger than TORCHYARD_MAX_CODE_UPLOAD_BYTES."}},
)
async def create_code(
    request: Request, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> CodePublic | JSONResponse:
    """Upload a source folder as an archive (multipart ``file``, optional ``name``). It is
    extracted safely (size caps; no traversal, links or devices) and stored by content.
    201 with id, name, sha256, size and file count."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "multipart/form-data":
        raise RequestValidationError(
            "send multipart/form-data with a 'file' part holding the archive", details={"field": "file"}
        )
    with ExitStack() as stack:
        upload = await receive_file_upload(
            request,
            stack,
            code_service.upload_workspace(settings, user),
            max_file_bytes=settings.max_code_upload_bytes,
            text_fields=frozenset({"name"}),
        )
        if isinstance(upload, JSONResponse):
            return upload
        name = upload.form.fields.get("name") or default_archive_name(upload.form.filename, "code")
        if len(name) > NAME_MAX:
            raise RequestValidationError(
                f"name is longer than {NAME_MAX} characters", details={"field": "name"}
            )
        row = await run_in_threadpool(
            code_service.create_from_archive, session, settings, user, name, upload.path, upload.work
        )
    return code_service.code_public(row)


@router.get("/v1/code")
def list_code(
    session: ReadSessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
) -> CodeList:
    """Code packages newest first (a user's own; all of them for admin)."""
    rows, next_cursor = code_service.list_code(session, user, limit=limit, cursor=cursor)
    return CodeList(items=[code_service.code_public(r) for r in rows], next_cursor=next_cursor)


@router.get("/v1/code/{code_id}")
def get_code(code_id: str, session: ReadSessionDep, user: CurrentUser) -> CodePublic:
    """One code package: name, sha256, size and file count."""
    return code_service.code_public(code_service.get_code(session, user, code_id))


@router.delete("/v1/code/{code_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_code(code_id: str, session: SessionDep, settings: SettingsDep, user: CurrentUser) -> Response:
    """Delete a code package; 409 while a queued or running job uses it."""
    code_service.delete_code(session, settings, user, code_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/v1/code/uploads")
def plan_code_upload(
    body: CodeUploadRequest, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> UploadPlan:
    """Where to put a code package's archive (docs/storage.md): with object storage,
    presigned parts, once the manifest (the files and their checksum) passes the checks
    (422 otherwise, nothing recorded). ``mode "api"`` with file storage: ``POST /v1/code``."""
    storage = direct_uploads.storage_of(settings)
    if not storage.direct:
        return direct_uploads.api_plan("/v1/code")
    return code_service.plan_direct_upload(session, settings, storage, user, body)


@router.post("/v1/code/uploads/{upload_id}", status_code=status.HTTP_201_CREATED)
def complete_code_upload(
    upload_id: str, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> CodePublic:
    """Record the package whose archive is in the object store (409 while parts are missing);
    201 as ``POST /v1/code`` answers."""
    storage = direct_uploads.storage_of(settings)
    row = code_service.complete_direct_upload(session, settings, storage, user, upload_id)
    return code_service.code_public(row)


@router.get(
    "/v1/worker/code/{code_id}/archive",
    tags=["worker"],
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}, 307: {"description": "Object storage."}},
)
def code_archive(
    code_id: str, request: Request, session: ReadSessionDep, settings: SettingsDep, worker: WorkerDep
) -> Response:
    """The package's files as a deterministic tar with its checksum in ``X-Torchyard-Sha256``;
    only for a package that a job placed on one of the worker's nodes uses. A package kept
    as an archive in the object store: a redirect to it (the node checks the checksum)."""
    row = code_service.code_for_worker(session, worker, code_id)
    if row.archive_key is not None:
        storage = direct_uploads.storage_of(settings)
        served = stored_file(
            storage,
            row.archive_key,
            sha256=row.sha256,
            filename=f"{row.id}.{archive_suffix(row.archive_key)}",
            what=f"code package {row.id!r}",
        )
        return object_response(
            request,
            storage,
            row.archive_key,
            served,
            ttl_s=settings.storage_url_ttl_s,
            media_type="application/octet-stream",
            extra_headers={
                SHA256_HEADER: row.sha256,
                FILES_HEADER: str(row.files),
                CONTENT_BYTES_HEADER: str(row.size_bytes),
            },
        )
    tar = code_service.code_tar(settings, row)
    headers = {
        "Content-Length": str(tar.size),
        SHA256_HEADER: row.sha256,
        "ETag": f'"{row.sha256}"',
    }
    return StreamingResponse(iter(tar), media_type="application/x-tar", headers=headers)
