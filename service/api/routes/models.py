"""The model registry and scoring (docs/models.md).

* ``POST /v1/models`` registers a succeeded training job's model (or, with ``path``, the model
  directory in that folder of a succeeded script job's outputs) as the next version of a name;
* ``GET /v1/models``, ``GET /v1/models/{name}``, ``GET/DELETE /v1/models/{name}/versions/{version}``
  (``version`` may be ``latest``);
* ``POST /v1/models/{name}/versions/{version}/predict``: multipart ``files`` and ``top_k``;
* ``GET /v1/models/{name}/versions/{version}/onnx`` and ``GET /v1/jobs/{id}/model/onnx``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response, status
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.types import Message

from service.api.deps import CurrentUser, DatabaseDep, ReadSessionDep, SessionDep, SettingsDep
from service.api.files import file_response
from service.api.routes.dataset_bodies import MULTIPART_OVERHEAD, check_content_length
from service.api.routing import SessionScopedRoute
from service.config import Settings
from service.db.engine import Database
from service.schemas.models import (
    FilePrediction,
    LabelProbability,
    ModelList,
    ModelPublic,
    ModelRegister,
    ModelVersionPublic,
    PredictResponse,
)
from service.services import models as models_service
from service.services import scoring
from service.services.artifacts import ModelFile
from service.services.jobs import get_job
from service.services.kinds import kind_of
from service.services.models import ModelFiles
from service.services.scoring_pool import ScoringPool
from service.services.tokens import Principal
from service.states import JobStatus
from torchyard.contract.errors import ModelNotReadyError, PayloadTooLargeError, RequestValidationError
from torchyard.contract.model_archive import sha256_of
from torchyard.scoring import ONNX_FILE

router = APIRouter(tags=["models"], route_class=SessionScopedRoute)

_ONNX_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "The ONNX model."},
    409: {"description": "ModelNotReadyError: no ONNX export (or the job has not succeeded)."},
}


def scoring_pool(request: Request) -> ScoringPool:
    """The app's scoring processes (started on first use, ended with the app)."""
    pool: ScoringPool | None = getattr(request.app.state, "scoring_pool", None)
    if pool is None:
        settings: Settings = request.app.state.settings
        pool = ScoringPool(
            settings.predict_workers,
            memory_bytes=settings.predict_worker_memory_bytes,
            cpu_s=settings.predict_cpu_s,
            timeout_s=settings.predict_timeout_s,
            max_models=settings.model_cache_models,
            max_bytes=settings.model_cache_bytes,
        )
        request.app.state.scoring_pool = pool
    return pool


@router.post("/v1/models", status_code=status.HTTP_201_CREATED)
def register_model(
    body: ModelRegister, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> ModelVersionPublic:
    """Register the model directory of a succeeded training job (``{name, job_id}``), or the
    one in the folder ``path`` of a succeeded script job's outputs (``{name, job_id, path}``),
    as the next version of ``name``."""
    row = models_service.register_model(session, settings, user, body.name, body.job_id, body.path)
    return models_service.version_public(row, models_service.source_top1(session, [row]).get(row.job_id))


@router.get("/v1/models")
def list_models(session: ReadSessionDep, user: CurrentUser) -> ModelList:
    """Your models, each with its versions (oldest first) and its latest version number."""
    return ModelList(items=models_service.list_models(session, user))


@router.get("/v1/models/{name}")
def get_model(name: str, session: ReadSessionDep, user: CurrentUser) -> ModelPublic:
    return models_service.get_model(session, user, name)


@router.get("/v1/models/{name}/versions/{version}")
def get_version(name: str, version: str, session: ReadSessionDep, user: CurrentUser) -> ModelVersionPublic:
    """One version; ``version`` may be ``latest``."""
    row = models_service.get_version(session, user, name, version)
    return models_service.version_public(row, models_service.source_top1(session, [row]).get(row.job_id))


@router.delete("/v1/models/{name}/versions/{version}")
def delete_version(name: str, version: str, session: SessionDep, user: CurrentUser) -> ModelVersionPublic:
    """Delete a version (its number is not given again); 409 while an evaluation uses it."""
    return models_service.version_public(models_service.delete_version(session, user, name, version))


def _version_files(
    db: Database, settings: Settings, user: Principal, name: str, version: str
) -> tuple[ModelVersionPublic, ModelFiles]:
    with db.read_session() as session:
        row = models_service.get_version(session, user, name, version)
        return models_service.version_public(row), models_service.model_files(session, settings, row)


def _onnx_file(files: ModelFiles, filename: str) -> ModelFile:
    path = files.folder / ONNX_FILE
    if not path.is_file():
        raise ModelNotReadyError("this model has no ONNX export (it was dropped at training time)")
    return ModelFile(path=path, sha256=sha256_of(path), size=path.stat().st_size, filename=filename)


@router.head("/v1/models/{name}/versions/{version}/onnx", include_in_schema=False)
@router.get("/v1/models/{name}/versions/{version}/onnx", response_class=Response, responses=_ONNX_RESPONSES)
def download_version_onnx(
    name: str, version: str, request: Request, db: DatabaseDep, settings: SettingsDep, user: CurrentUser
) -> Response:
    """The version's ONNX export (dynamic batch; input ``input``, output ``logits``)."""
    public, files = _version_files(db, settings, user, name, version)
    return file_response(request, _onnx_file(files, f"{public.name}-{public.version}.onnx"))


def _job_onnx(db: Database, settings: Settings, user: Principal, job_id: str) -> ModelFile:
    with db.read_session() as session:
        job = get_job(session, user, job_id)
        if job.status != JobStatus.SUCCEEDED or not kind_of(job).keeps_model:
            raise ModelNotReadyError(f"job {job.id} is {job.status}: it has no model directory to export")
        folder = models_service.unpacked_job_model(settings, job)
        name = f"{job.name}-{job.id}.onnx"
    return _onnx_file(ModelFiles(key=job.id, folder=folder, sha256=""), name)


@router.head("/v1/jobs/{job_id}/model/onnx", include_in_schema=False)
@router.get("/v1/jobs/{job_id}/model/onnx", tags=["jobs"], response_class=Response, responses=_ONNX_RESPONSES)
def download_job_onnx(
    job_id: str, request: Request, db: DatabaseDep, settings: SettingsDep, user: CurrentUser
) -> Response:
    """The ONNX export of a succeeded job's model; 409 until it succeeded or when the export was dropped."""
    return file_response(request, _job_onnx(db, settings, user, job_id))


def _too_many_images(settings: Settings, count: int | None) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        ("more images" if count is None else f"{count} images, more")
        + f" than the limit of {settings.predict_max_files} per request: send them in several requests",
        details={"limit": settings.predict_max_files},
    )


async def _read_images(request: Request, settings: Settings) -> tuple[list[scoring.UploadedImage], int]:
    """The multipart body's ``files`` and ``top_k``, within the caps on bytes and count."""
    limit = settings.predict_max_bytes + MULTIPART_OVERHEAD
    check_content_length(request, limit)
    received = 0
    receive = request.receive

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise PayloadTooLargeError(
                f"the request body is more than the limit of {settings.predict_max_bytes} bytes",
                details={"limit": settings.predict_max_bytes},
            )
        return message

    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise RequestValidationError("send the images as multipart/form-data, in fields named 'files'")
    # The parser stops at the first file over the cap: a request with more images is the
    # same 413 whichever part of it shows the count (and nothing past the cap is kept).
    parser = MultiPartParser(
        request.headers,
        Request(request.scope, counted).stream(),
        max_files=settings.predict_max_files,
        max_fields=8,
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        if exc.message.startswith("Too many files"):
            raise _too_many_images(settings, None) from None
        raise RequestValidationError(f"the multipart body cannot be read: {exc.message}") from None
    try:
        uploads = [part for part in form.getlist("files") if isinstance(part, UploadFile)]
        if not uploads:
            raise RequestValidationError("no images: send one or more in multipart fields named 'files'")
        if len(uploads) > settings.predict_max_files:
            raise _too_many_images(settings, len(uploads))
        top_k_raw = form.get("top_k", "3")
        if not isinstance(top_k_raw, str) or not (top_k_raw.isascii() and top_k_raw.strip().isdigit()):
            raise RequestValidationError(
                "top_k must be a whole number from 1 to 100", details={"field": "top_k"}
            )
        top_k = int(top_k_raw.strip())
        if not 1 <= top_k <= scoring.MAX_TOP_K:
            raise RequestValidationError(
                "top_k must be a whole number from 1 to 100", details={"field": "top_k"}
            )
        images = [
            scoring.UploadedImage(filename=part.filename or f"file-{n}", data=await part.read())
            for n, part in enumerate(uploads)
        ]
    finally:
        await form.close()
    return images, top_k


@router.post(
    "/v1/models/{name}/versions/{version}/predict",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {
                            "files": {"type": "array", "items": {"type": "string", "format": "binary"}},
                            "top_k": {"type": "integer", "default": 3, "minimum": 1, "maximum": 100},
                        },
                        "required": ["files"],
                    }
                }
            },
        }
    },
)
async def predict(
    name: str, version: str, request: Request, db: DatabaseDep, settings: SettingsDep, user: CurrentUser
) -> PredictResponse:
    """Labels and probabilities for one or more images (multipart ``files``; ``top_k``,
    default 3). Each image is preprocessed exactly as the model directory's validation
    transform; the model runs through its ONNX export."""
    public, files = await run_in_threadpool(_version_files, db, settings, user, name, version)
    uploads, top_k = await _read_images(request, settings)
    batch = await run_in_threadpool(
        scoring.prepare_batch,
        files,
        uploads,
        public.image_size,
        settings.predict_max_image_pixels,
        settings.predict_max_total_pixels,
    )
    results = await scoring_pool(request).predict(
        files.key, files.folder, batch, top_k, request.is_disconnected
    )
    return PredictResponse(
        name=public.name,
        version=public.version,
        predictions=[
            FilePrediction(
                file=upload.filename, top=[LabelProbability(label=label, probability=p) for label, p in top]
            )
            for upload, top in zip(uploads, results, strict=True)
        ],
    )
