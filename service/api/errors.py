"""Every error a request can meet, turned into a JSON body with a machine-readable code."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from torchyard.errors import TorchyardError

log = logging.getLogger(__name__)

_HTTP_CODES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "PayloadTooLargeError",
    415: "UnsupportedMediaTypeError",
    416: "RangeNotSatisfiableError",
}


def _allowed_for(models: list[type[BaseModel]], loc: tuple[Any, ...]) -> str | None:
    """The ``allowed`` text of the schema field at ``loc`` (body.parameters.epochs → "> 0")."""
    for model in models:
        current: Any = model
        allowed = None
        for part in loc:
            fields = getattr(current, "model_fields", None)
            if not fields or part not in fields:
                allowed = None
                break
            field = fields[part]
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            allowed = extra.get("allowed")
            current = field.annotation
        if allowed is not None:
            return str(allowed)
    return None


def _validation_body(exc: FastAPIValidationError, request: Request) -> dict[str, Any]:
    from service.schemas.jobs import JobCreate

    errors = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        where = loc[0] if loc else "body"
        path = (
            [str(p) for p in loc[1:]] if where in ("body", "query", "path", "header") else list(map(str, loc))
        )
        field = ".".join(path) or str(where)
        item: dict[str, Any] = {
            "field": field,
            "in": where,
            "message": err.get("msg", "invalid"),
            "type": err.get("type"),
        }
        if err.get("type") == "extra_forbidden":
            item["message"] = f"unknown field {field!r}"
        allowed = _allowed_for([JobCreate], tuple(loc[1:])) if where == "body" else None
        if allowed is not None:
            item["allowed"] = allowed
        if (
            "input" in err
            and err.get("type") != "missing"
            and isinstance(err["input"], str | int | float | bool)
        ):
            value = err["input"]
            # NaN and infinity are not JSON: echo them as text.
            item["value"] = value if not isinstance(value, float) or math.isfinite(value) else str(value)
        errors.append(item)
    summary = "; ".join(
        f"{e['field']}: {e['message']}" + (f" (allowed: {e['allowed']})" if "allowed" in e else "")
        for e in errors
    )
    return {"code": "ValidationError", "message": f"invalid request: {summary}", "errors": errors}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TorchyardError)
    async def _domain(_request: Request, exc: TorchyardError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code)

    @app.exception_handler(FastAPIValidationError)
    async def _validation(request: Request, exc: FastAPIValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(exc, request), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "HTTPError")
        return JSONResponse(
            {"code": code, "message": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(
            {"code": "InternalError", "message": "internal error; see the service log"}, status_code=500
        )
