"""Pretrained weights routes (docs/fine-tuning.md): upload, list, show, delete (admin); and the
worker's download."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import CurrentUser, ReadSessionDep, SessionDep, SettingsDep, WorkerDep
from service.api.files import object_response
from service.api.routes.dataset_bodies import receive_file_upload
from service.api.routing import SessionScopedRoute
from service.schemas.weights import WeightsUploadRequest
from service.services import direct_uploads
from service.services import weights as weights_service
from torchyard.contract.errors import RequestValidationError
from torchyard.contract.headers import SHA256_HEADER
from torchyard.contract.responses import WeightsPublic
from torchyard.contract.transfer import UploadPlan

router = APIRouter(tags=["weights"], route_class=SessionScopedRoute)

_CREATE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["architecture", "file"],
                    "properties": {
                        "architecture": {
                            "type": "string",
                            "description": "The torchvision classification model the state dict is for.",
                        },
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "The state dict, as torch.save(model.state_dict(), path) "
                            "writes it (a torchvision weights file such as resnet50-0676ba61.pth).",
                        },
                    },
                }
            }
        },
    }
}


@router.post(
    "/v1/weights",
    status_code=status.HTTP_201_CREATED,
    response_model=WeightsPublic,
    openapi_extra=_CREATE_BODY,
    responses={413: {"description": "The upload is larger than TORCHYARD_MAX_WEIGHTS_UPLOAD_BYTES."}},
)
async def create_weights(
    request: Request, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> WeightsPublic | JSONResponse:
    """Upload a state dict for an architecture (multipart ``architecture`` and ``file``). The
    file must be a torch archive; a name carrying a sha256 prefix (``resnet50-0676ba61.pth``)
    must match the file. 201 with id, architecture and sha256; the same file again answers
    the stored row."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "multipart/form-data":
        raise RequestValidationError(
            "send multipart/form-data with an 'architecture' field and a 'file' part holding the state dict",
            details={"field": "file"},
        )
    with ExitStack() as stack:
        upload = await receive_file_upload(
            request,
            stack,
            weights_service.upload_workspace(settings, user),
            max_file_bytes=settings.max_weights_upload_bytes,
            text_fields=frozenset({"architecture"}),
        )
        if isinstance(upload, JSONResponse):
            return upload
        architecture = upload.form.fields.get("architecture")
        if not architecture:
            raise RequestValidationError(
                "the multipart body has no 'architecture' field", details={"field": "architecture"}
            )
        filename = Path(upload.form.filename or "weights.pth").name
        row = await run_in_threadpool(
            weights_service.create, session, settings, user, architecture, filename, upload.path
        )
    return weights_service.public(row)


@router.post("/v1/weights/uploads")
def plan_weights_upload(
    body: WeightsUploadRequest, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> UploadPlan:
    """Where to put a state dict (docs/storage.md): with object storage, presigned parts,
    once the architecture and a sha256 prefix in the file's name pass (422 otherwise); the
    same request again resumes. ``mode "api"`` with file storage: ``POST /v1/weights``."""
    storage = direct_uploads.storage_of(settings)
    if not storage.direct:
        return direct_uploads.api_plan("/v1/weights")
    return weights_service.plan_direct_upload(session, settings, storage, user, body)


@router.post("/v1/weights/uploads/{upload_id}", status_code=status.HTTP_201_CREATED)
def complete_weights_upload(
    upload_id: str, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> WeightsPublic:
    """Record the weights whose file is in the object store (409 while parts are missing);
    201 as ``POST /v1/weights`` answers."""
    storage = direct_uploads.storage_of(settings)
    return weights_service.public(weights_service.complete_direct_upload(session, storage, user, upload_id))


@router.get("/v1/weights")
def list_weights(
    session: ReadSessionDep,
    user: CurrentUser,
    architecture: Annotated[str | None, Query(max_length=100)] = None,
) -> list[WeightsPublic]:
    """Stored weights newest first (everyone's: weights are shared), one architecture's if given."""
    return [weights_service.public(r) for r in weights_service.list_weights(session, architecture)]


@router.get("/v1/weights/{weights_id}")
def get_weights(weights_id: str, session: ReadSessionDep, user: CurrentUser) -> WeightsPublic:
    """One stored state dict: architecture, file name, sha256 and size."""
    return weights_service.public(weights_service.get_weights(session, weights_id))


@router.delete("/v1/weights/{weights_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_weights(
    weights_id: str, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> Response:
    """Delete stored weights (admin only)."""
    weights_service.delete_weights(session, settings, user, weights_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get(
    "/v1/worker/weights/{weights_id}/file",
    tags=["worker"],
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def weights_download(
    weights_id: str, request: Request, session: ReadSessionDep, settings: SettingsDep, worker: WorkerDep
) -> Response:
    """The stored file, with its checksum in ``X-Torchyard-Sha256`` (the node verifies it);
    with object storage, a redirect to it."""
    row = weights_service.get_weights(session, weights_id)
    storage = direct_uploads.storage_of(settings)
    if storage.direct:
        return object_response(
            request,
            storage,
            weights_service.weights_key(row.sha256),
            weights_service.stored(settings, row),
            ttl_s=settings.storage_url_ttl_s,
            media_type="application/octet-stream",
            extra_headers={SHA256_HEADER: row.sha256},
        )
    return FileResponse(
        weights_service.weights_file(settings, row),
        media_type="application/octet-stream",
        headers={SHA256_HEADER: row.sha256, "ETag": f'"{row.sha256}"'},
    )
