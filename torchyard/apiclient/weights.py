"""Pretrained weights: ``POST /v1/weights`` (a state dict for an architecture), the list, one,
and an admin's delete (docs/fine-tuning.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from torchyard.apiclient.transport import Transport, segment
from torchyard.contract.responses import WeightsPublic


class WeightsCalls:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def upload_weights(
        self, architecture: str, file: str | Path, *, timeout: float = 3600.0
    ) -> WeightsPublic:
        """Upload a state dict (``torch.save(model.state_dict(), file)``, or a torchvision
        weights file) as the pretrained weights of ``architecture``."""
        path = Path(file)
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
