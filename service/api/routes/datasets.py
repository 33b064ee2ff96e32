"""Dataset routes: upload or register, list, show, delete; and the worker's download."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from service.api.deps import CurrentUser, ReadSessionDep, SessionDep, SettingsDep, WorkerDep
from service.api.files import object_response
from service.api.routes.dataset_bodies import receive_json, receive_multipart
from service.api.routing import SessionScopedRoute
from service.schemas.datasets import NAME_MAX, DatasetList, DatasetRegister, DatasetUploadRequest
from service.services import datasets as datasets_service
from service.services import direct_uploads
from service.services.stored_archives import archive_suffix, stored_file
from torchyard.contract.errors import RequestValidationError, TorchyardError
from torchyard.contract.headers import CONTENT_BYTES_HEADER, FILES_HEADER, SHA256_HEADER
from torchyard.contract.responses import DatasetPublic
from torchyard.contract.transfer import UploadPlan

router = APIRouter(tags=["datasets"], route_class=SessionScopedRoute)


class _UnsupportedMediaType(TorchyardError):
    code = "UnsupportedMediaTypeError"
    status_code = 415


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
                            "description": "Dataset name (default: the file name).",
                        },
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": ".zip, .tar, .tar.gz/.tgz, .tar.bz2 or .tar.xz archive of "
                            "class folders (one wrapping folder allowed).",
                        },
                    },
                }
            },
            "application/json": {"schema": DatasetRegister.model_json_schema()},
        },
    }
}

_ARCHIVE_SUFFIXES = (".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".zip", ".tar")


def default_archive_name(filename: str | None, fallback: str = "dataset") -> str:
    """An upload's name when none is given: its file name without the archive suffix."""
    base = Path(filename or "").name
    for suffix in _ARCHIVE_SUFFIXES:
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base[:NAME_MAX] or fallback


@router.post(
    "/v1/datasets",
    status_code=status.HTTP_201_CREATED,
    response_model=DatasetPublic,
    openapi_extra=_CREATE_BODY,
    responses={413: {"description": "The upload is larger than the configured limit."}},
)
async def create_dataset(
    request: Request, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> DatasetPublic | JSONResponse:
    """Create a dataset from an uploaded archive (multipart ``name``, ``file``), or register
    a folder on shared storage (JSON ``{name, path, sample?}``). The upload is streamed to
    disk and refused with 413 past the size limit; archives are extracted safely and every
    image is decoded before the dataset is recorded. 201 with classes, per-class counts,
    image count, size and the content sha256."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type == "multipart/form-data":
        with ExitStack() as stack:
            try:
                work = stack.enter_context(datasets_service.upload_workspace(settings, user))
                dest = work / "upload.part"
                form = await receive_multipart(
                    request, dest, max_file_bytes=settings.max_upload_bytes, text_fields=frozenset({"name"})
                )
            except TorchyardError as exc:
                # The rest of the body is not wanted: close the connection after this answer
                # rather than let the server drain what the client is still sending.
                return JSONResponse(
                    exc.to_dict(), status_code=exc.status_code, headers={"Connection": "close"}
                )
            if not form.has_file:
                raise RequestValidationError(
                    "the multipart body has no 'file' part", details={"field": "file"}
                )
            name = form.fields.get("name") or default_archive_name(form.filename)
            if len(name) > NAME_MAX:
                raise RequestValidationError(f"name is longer than {NAME_MAX} characters")
            row = await run_in_threadpool(
                datasets_service.create_from_archive, session, settings, user, name, dest, work
            )
    elif content_type == "application/json":
        payload = await receive_json(request)
        try:
            body = DatasetRegister.model_validate(payload)
        except ValidationError as exc:
            raise FastAPIValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            ) from None
        row = await run_in_threadpool(datasets_service.register_path, session, settings, user, body)
    else:
        raise _UnsupportedMediaType(
            "send multipart/form-data (name, file) to upload an archive, "
            "or application/json {name, path} to register a folder"
        )
    return datasets_service.dataset_public(row)


@router.get("/v1/datasets")
def list_datasets(
    session: ReadSessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
) -> DatasetList:
    """Datasets newest first (a user's own; all of them for admin); follow ``next_cursor`` for more."""
    rows, next_cursor = datasets_service.list_datasets(session, user, limit=limit, cursor=cursor)
    return DatasetList(items=[datasets_service.dataset_public(r) for r in rows], next_cursor=next_cursor)


@router.get("/v1/datasets/{dataset_id}")
def get_dataset(dataset_id: str, session: ReadSessionDep, user: CurrentUser) -> DatasetPublic:
    """One dataset: classes, per-class counts, image count, size and sha256."""
    return datasets_service.dataset_public(datasets_service.get_dataset(session, user, dataset_id))


@router.delete("/v1/datasets/{dataset_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_dataset(
    dataset_id: str, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> Response:
    """Delete a dataset; 409 while a queued or running job uses it."""
    datasets_service.delete_dataset(session, settings, user, dataset_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/v1/datasets/uploads")
def plan_dataset_upload(
    body: DatasetUploadRequest, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> UploadPlan:
    """Where to put a dataset's archive (docs/storage.md): with object storage, presigned
    parts, once the manifest (the files, their checksum, the classes) passes the layout
    rules (422 otherwise, nothing recorded); the same request again resumes the upload.
    ``mode "api"`` with file storage: upload it with ``POST /v1/datasets``."""
    storage = direct_uploads.storage_of(settings)
    if not storage.direct:
        return direct_uploads.api_plan("/v1/datasets")
    return datasets_service.plan_direct_upload(session, settings, storage, user, body)


@router.post("/v1/datasets/uploads/{upload_id}", status_code=status.HTTP_201_CREATED)
def complete_dataset_upload(
    upload_id: str, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> DatasetPublic:
    """Record the dataset whose archive is in the object store (409 while parts are missing:
    ask for the plan again). 201 as ``POST /v1/datasets`` answers; the nodes check the
    archive's files against the manifest when they fetch it."""
    storage = direct_uploads.storage_of(settings)
    row = datasets_service.complete_direct_upload(session, settings, storage, user, upload_id)
    return datasets_service.dataset_public(row)


@router.get(
    "/v1/worker/datasets/{dataset_id}/archive",
    tags=["worker"],
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}, 307: {"description": "Object storage."}},
)
def dataset_archive(
    dataset_id: str, request: Request, session: ReadSessionDep, settings: SettingsDep, worker: WorkerDep
) -> Response:
    """The dataset's files as a deterministic tar (class folders at the top), with its content
    checksum in ``X-Torchyard-Sha256``; only for a dataset that a job placed on one of the
    worker's nodes uses. A dataset kept as an archive in the object store: a redirect to it
    (any archive format, possibly one wrapping folder; the node checks the content checksum)."""
    row = datasets_service.dataset_for_worker(session, worker, dataset_id)
    if row.archive_key is not None:
        storage = direct_uploads.storage_of(settings)
        served = stored_file(
            storage,
            row.archive_key,
            sha256=row.sha256,
            filename=f"{row.id}.{archive_suffix(row.archive_key)}",
            what=f"dataset {row.id!r}",
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
                FILES_HEADER: str(row.num_images),
                CONTENT_BYTES_HEADER: str(row.size_bytes),
            },
        )
    tar = datasets_service.dataset_tar(settings, row)
    headers = {
        "Content-Length": str(tar.size),
        SHA256_HEADER: row.sha256,
        FILES_HEADER: str(len(tar.members)),
        "ETag": f'"{row.sha256}"',
    }
    return StreamingResponse(iter(tar), media_type="application/x-tar", headers=headers)
