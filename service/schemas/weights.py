"""Pretrained weights request schemas (docs/fine-tuning.md)."""

from __future__ import annotations

from pydantic import Field

from torchyard.contract.transfer import UploadRequest


class WeightsUploadRequest(UploadRequest):
    """A direct upload of a state dict (object storage, docs/storage.md): the file's transfer
    (its ``filename`` as the user has it) and the architecture it is for."""

    architecture: str = Field(
        min_length=1,
        max_length=100,
        description="The torchvision classification model the state dict is for.",
    )
