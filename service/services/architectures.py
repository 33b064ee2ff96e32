"""The one check that a name is a model the trainer can build (a job's, or stored weights')."""

from __future__ import annotations

from typing import Any

from torchyard.architectures import CLASSIFICATION_ARCHITECTURES, closest_architecture
from torchyard.contract.errors import InvalidModelDirectoryError


def check_architecture(arch: str, field: str = "model.architecture") -> None:
    """422 for a name that is not a torchvision classification model (with a suggestion)."""
    if arch in CLASSIFICATION_ARCHITECTURES:
        return
    suggestion = closest_architecture(arch)
    hint = (
        f"did you mean {suggestion}?"
        if suggestion
        else "use a torchvision classification model name such as resnet18, resnet50 or densenet121"
    )
    details: dict[str, Any] = {"field": field, "value": arch}
    if suggestion:
        details["suggestion"] = suggestion
    raise InvalidModelDirectoryError(f"unknown architecture {arch!r}: {hint}", details=details)
