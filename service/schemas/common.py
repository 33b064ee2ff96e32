"""Shared pieces of request/response schemas."""

from __future__ import annotations

import base64
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from torchyard.contract.errors import RequestValidationError


class StrictModel(BaseModel):
    """A request body: unknown fields are refused and values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", strict=True)


def encode_cursor(*parts: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(parts).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list[Any]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        parts = json.loads(base64.urlsafe_b64decode(padded.encode()))
    except ValueError as exc:
        raise RequestValidationError("cursor is not one this service issued") from exc
    if not isinstance(parts, list) or len(parts) != arity:
        raise RequestValidationError("cursor is not one this service issued")
    return parts
