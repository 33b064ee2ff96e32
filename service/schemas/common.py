"""Shared pieces of request/response schemas."""

from __future__ import annotations

import base64
import difflib
import json
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

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


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The request model an annotation holds: itself, or the first inside ``X | None``,
    ``list[X]``, ``Annotated[X, ...]``."""
    if isinstance(annotation, type) and not isinstance(annotation, types.GenericAlias):
        return annotation if issubclass(annotation, BaseModel) else None
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def field_names_at(model: Any, path: Sequence[Any]) -> list[str] | None:
    """The field names (as a request spells them) of the model found at ``path`` below
    ``model`` (list positions skipped); None where the path leaves the models."""
    current = _model_in(model)
    for part in path:
        if isinstance(part, int) or current is None:
            continue
        fields = current.model_fields
        by_alias = {(f.alias or name): f for name, f in fields.items()}
        if part not in by_alias:
            return None
        current = _model_in(by_alias[part].annotation)
    if current is None:
        return None
    return [f.alias or name for name, f in current.model_fields.items()]


def closest_name(name: str, known: Sequence[str]) -> str | None:
    """The known name a mistyped ``name`` most likely means (``epoch`` for ``epochs``,
    another case, a swapped or missing character); None when none is close."""
    by_lower = {k.lower(): k for k in known}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), sorted(by_lower), n=1, cutoff=0.75)
    return by_lower[close[0]] if close else None


def suggested_field(model: Any, path: Sequence[Any]) -> str | None:
    """For an unknown field at ``path`` (its last part the unknown name), the dotted path of
    the field of that level it most likely means, e.g. ``parameters.epochs`` for
    ``parameters.epoch``; None when no field is close."""
    if not path or not isinstance(path[-1], str):
        return None
    known = field_names_at(model, path[:-1])
    found = closest_name(path[-1], known or [])
    if found is None:
        return None
    return ".".join([*(str(p) for p in path[:-1]), found])
