"""Base classes of the contract's models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A request body: unknown fields are refused and values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", strict=True)
