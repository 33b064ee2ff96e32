"""``GET /v1/storage``: how artifacts' bytes travel (docs/storage.md), so that a client asks
once whether to PUT them to the API or to the object store with presigned URLs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from service.api.deps import SettingsDep, get_principal
from service.api.routing import SessionScopedRoute
from service.api.traffic import TRAFFIC
from service.services.direct_uploads import storage_of
from service.services.tokens import Principal
from torchyard.contract.transfer import PART_BYTES

router = APIRouter(route_class=SessionScopedRoute)


class Traffic(BaseModel):
    received: int
    sent: int


class StorageInfo(BaseModel):
    direct: bool
    part_bytes: int
    api_artifact_bytes: Traffic


@router.get("/v1/storage", tags=["cluster"])
def storage_info(settings: SettingsDep, _: Annotated[Principal, Depends(get_principal)]) -> StorageInfo:
    """``direct``: artifacts go to and come from the object store with presigned URLs (the
    upload routes' ``.../upload`` plans); false: through the API's own routes.
    ``api_artifact_bytes``: the artifact bytes this API process received and sent since it
    started (request and response bodies of the artifact routes, JSON excepted)."""
    return StorageInfo(
        direct=storage_of(settings).direct,
        part_bytes=PART_BYTES,
        api_artifact_bytes=Traffic(received=TRAFFIC.received, sent=TRAFFIC.sent),
    )
