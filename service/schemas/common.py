"""Shared pieces of request/response schemas."""

from __future__ import annotations

import base64
import json
from typing import Any

from torchyard.contract.base import StrictModel  # noqa: F401 - the service's request base
from torchyard.contract.errors import RequestValidationError


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
