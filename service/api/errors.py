"""Every error a request can meet, turned into a JSON body with a machine-readable code."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service.db.engine import is_unavailable
from service.schemas.common import suggested_field
from torchyard.contract.errors import ServiceUnavailableError, TorchyardError

log = logging.getLogger(__name__)

_SURROGATE = re.compile("[\ud800-\udfff]")

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
    422: "ValidationError",
}


class ErrorResponse(JSONResponse):
    """A JSON error body that can always be sent.

    Error messages echo what the client sent, which may hold lone UTF-16 surrogates
    (``"\\ud800"`` is valid JSON, but no UTF-8 text): they are written as ``\\udXXX``
    escapes in the text instead of failing the response.
    """

    def render(self, content: Any) -> bytes:
        return super().render(printable(content))


def printable(value: Any) -> Any:
    """``value`` with every string made encodable as UTF-8 (surrogates as ``\\udXXX`` text)."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable(v) for v in value]
    return value


def surrogate_field(value: Any, where: str = "") -> tuple[str, str] | None:
    """The first field of a parsed JSON body (a dotted path) whose name or text holds a lone
    UTF-16 surrogate, with that surrogate as ``\\udXXX`` text; None when all text is Unicode."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return (printable(where) or "body", f"\\u{ord(found.group()):04x}") if found else None
    if isinstance(value, dict):
        children = list(value.items())
    elif isinstance(value, list):
        children = list(enumerate(value))
    else:
        return None
    for key, item in children:
        path = f"{where}.{key}" if where else str(key)
        found_in = surrogate_field(key, path) or surrogate_field(item, path)
        if found_in is not None:
            return found_in
    return None


def surrogate_message(field: str, surrogate: str) -> str:
    return f"{field}: text holds a lone UTF-16 surrogate ({surrogate}), which is not Unicode; send valid text"


def malformed_json_message(reason: str, doc: str | bytes, pos: int) -> str:
    """Where and why a JSON body could not be parsed, with line and column."""
    text = doc.decode("utf-8", "replace") if isinstance(doc, bytes) else doc
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return f"malformed JSON at line {line}, column {column} (character {pos}): {reason}"


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


def _body_model(request: Request) -> Any:
    """The annotation of the body the request's route reads (None without one)."""
    body_field = getattr(request.scope.get("route"), "body_field", None)
    return getattr(getattr(body_field, "field_info", None), "annotation", None)


def _validation_body(exc: FastAPIValidationError, request: Request) -> dict[str, Any]:
    from service.schemas.jobs import JOB_CREATE_MODELS

    errors = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        body_model = _body_model(request)
        if len(loc) > 1 and loc[0] == "body" and loc[1] in JOB_CREATE_MODELS:
            # The job spec union's tag (its ``type``) is not a field of the body.
            body_model = JOB_CREATE_MODELS[loc[1]]
            loc = (loc[0], *loc[2:])
        if err.get("type") == "invalid_job_type":
            loc = ("body", "type")
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
            suggestion = suggested_field(body_model, loc[1:]) if where == "body" else None
            if suggestion is not None:
                item["message"] += f": did you mean {suggestion!r}?"
                item["suggestion"] = suggestion
        elif err.get("type") == "json_invalid":
            # FastAPI puts the character position where a field name would be.
            position = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
            reason = str((err.get("ctx") or {}).get("error", "invalid JSON"))
            item.update(field="body", position=position)
            item["message"] = malformed_json_message(reason, exc.body or "", position)
            errors.append(item)
            continue
        allowed = _allowed_for(list(JOB_CREATE_MODELS.values()), tuple(loc[1:])) if where == "body" else None
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
        (f"{e['field']}: " if e.get("type") != "json_invalid" else "")
        + e["message"]
        + (f" (allowed: {e['allowed']})" if "allowed" in e else "")
        for e in errors
    )
    return {"code": "ValidationError", "message": f"invalid request: {summary}", "errors": errors}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TorchyardError)
    async def _domain(_request: Request, exc: TorchyardError) -> JSONResponse:
        return ErrorResponse(exc.to_dict(), status_code=exc.status_code)

    @app.exception_handler(FastAPIValidationError)
    async def _validation(request: Request, exc: FastAPIValidationError) -> JSONResponse:
        return ErrorResponse(_validation_body(exc, request), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "HTTPError")
        return ErrorResponse(
            {"code": code, "message": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(ClientDisconnect)
    async def _disconnect(request: Request, _exc: ClientDisconnect) -> JSONResponse:
        # Nobody is left to read an answer: an ordinary event, not a server fault.
        log.info("client %s went away during %s %s", _peer(request), request.method, request.url.path)
        return ErrorResponse(
            {"code": "ClientDisconnectedError", "message": "the client closed the connection"},
            status_code=400,
        )

    @app.exception_handler(SQLAlchemyError)
    async def _database(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        if is_unavailable(exc):
            log.warning(
                "%s %s: the database is unreachable: %s",
                request.method,
                request.url.path,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return unavailable_response(request)
        log.exception("unexpected database error")
        return _internal_error()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return _internal_error()


def _internal_error() -> JSONResponse:
    return JSONResponse(
        {"code": "InternalError", "message": "internal error; see the service log"}, status_code=500
    )


def unavailable_response(request: Request) -> JSONResponse:
    """503 ``ServiceUnavailableError`` with ``Retry-After``: the database is unreachable."""
    retry_after = getattr(getattr(request.app.state, "settings", None), "retry_after_s", 2)
    error = ServiceUnavailableError(
        f"the service's database is unreachable; retry in {retry_after} s",
        details={"retry_after_s": retry_after},
    )
    return ErrorResponse(
        error.to_dict(), status_code=error.status_code, headers={"Retry-After": str(retry_after)}
    )


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "unknown"
