"""Pretrained weights: ``POST /v1/weights`` (a state dict for an architecture), the list, one,
and an admin's delete (docs/fine-tuning.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from torchyard.apiclient.datasets import stores_directly, upload_direct
from torchyard.apiclient.transport import Transport, segment
from torchyard.contract.errors import InvalidModelDirectoryError
from torchyard.contract.responses import WeightsPublic

# torch.save writes a zip archive (torch >= 1.6); the service takes no other format.
ZIP_MAGIC = b"PK\x03\x04"


class WeightsCalls:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def upload_weights(
        self, architecture: str, file: str | Path, *, timeout: float = 3600.0
    ) -> WeightsPublic:
        """Upload a state dict (``torch.save(model.state_dict(), file)``, or a torchvision
        weights file) as the pretrained weights of ``architecture``.

        With object storage (``GET /v1/storage``) the file goes straight to the store (the
        API never sees it: that it is a torch archive is checked here first)."""
        path = Path(file)
        if stores_directly(self._transport):
            with open(path, "rb") as fh:
                if fh.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
                    raise InvalidModelDirectoryError(
                        f"{path.name} is not a torch state dict archive (torch.save(model.state_dict(), "
                        "path) writes one); the file does not start as a zip archive does",
                        details={"field": "file"},
                    )
            data = upload_direct(
                self._transport, "/v1/weights/uploads", path, fields={"architecture": architecture}
            )
            return WeightsPublic.model_validate(data)
        with open(path, "rb") as fh:
            data = self._transport.json(
                "POST",
                "/v1/weights",
                data={"architecture": architecture},
                files={"file": (path.name, fh, "application/octet-stream")},
                timeout=httpx.Timeout(self._transport.timeout, read=timeout, write=timeout),
            )
        return WeightsPublic.model_validate(data)

    def list_weights(self, architecture: str | None = None) -> list[WeightsPublic]:
        params: dict[str, Any] = {"architecture": architecture} if architecture else {}
        items = self._transport.json("GET", "/v1/weights", params=params)
        return [WeightsPublic.model_validate(item) for item in items]

    def get_weights(self, weights_id: str) -> WeightsPublic:
        return WeightsPublic.model_validate(self._transport.json("GET", f"/v1/weights/{segment(weights_id)}"))

    def delete_weights(self, weights_id: str) -> None:
        """Delete stored weights (admin only)."""
        self._transport.request("DELETE", f"/v1/weights/{segment(weights_id)}")
