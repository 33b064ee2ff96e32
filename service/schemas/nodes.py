"""Node registry schemas."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel


class NodeRegister(StrictModel):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    address: str = Field(min_length=1, max_length=255, description="Address other nodes can reach.")
    units: int = Field(ge=1, le=1024, description="Processing units: GPUs, or CPU slots.")
    accelerator: str = Field(default="cpu", min_length=1, max_length=64)
    info: dict[str, Any] | None = None


class NodePublic(BaseModel):
    name: str
    address: str
    units: int
    free_units: int
    accelerator: str
    status: str
    last_heartbeat_at: datetime
    registered_at: datetime
    running_attempts: list[str] = []


class ClusterPublic(BaseModel):
    max_nodes: int
    max_units_per_node: int
    ready_nodes: int
    nodes: list[NodePublic]
