"""The model registry and scoring: register, list, show, delete, predict, ONNX download."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchyard.apiclient.models import ApiModel
from torchyard.apiclient.transport import Transport, segment

LATEST = "latest"
# Images sent per predict request (the service's default cap is 64).
PREDICT_BATCH = 32


class ModelVersion(ApiModel):
    name: str
    version: int
    job_id: str
    path: str | None = None
    architecture: str = ""
    classes: list[str] = []
    image_size: int = 0
    sha256: str = ""
    onnx: bool = False
    # The best validation top-1 (0-1) its job reported; None where it reported none.
    top1: float | None = None


class RegisteredModel(ApiModel):
    name: str
    latest_version: int
    versions: list[ModelVersion] = []


def parse_model_ref(ref: str) -> tuple[str, str]:
    """``NAME[:VERSION]`` as ``(name, version)``; no version means ``latest``."""
    name, _, version = ref.partition(":")
    if not name:
        raise ValueError(f"model reference {ref!r} has no name (write NAME or NAME:VERSION)")
    return name, version or LATEST


def _version_path(name: str, version: str | int) -> str:
    return f"/v1/models/{segment(name)}/versions/{segment(str(version))}"


class RegistryCalls:
    """The ``/v1/models`` routes."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def register_model(self, name: str, job_id: str, path: str | None = None) -> ModelVersion:
        """Register a succeeded training job's model (or, with ``path``, the model directory in
        that folder of a succeeded script job's outputs) as the next version of ``name``."""
        body: dict[str, Any] = {"name": name, "job_id": job_id}
        if path is not None:
            body["path"] = path
        return ModelVersion.model_validate(self._transport.json("POST", "/v1/models", json=body))

    def list_models(self) -> list[RegisteredModel]:
        items = self._transport.json("GET", "/v1/models")["items"]
        return [RegisteredModel.model_validate(item) for item in items]

    def get_model(self, name: str) -> RegisteredModel:
        return RegisteredModel.model_validate(self._transport.json("GET", f"/v1/models/{segment(name)}"))

    def get_model_version(self, name: str, version: str | int = LATEST) -> ModelVersion:
        return ModelVersion.model_validate(self._transport.json("GET", _version_path(name, version)))

    def delete_model_version(self, name: str, version: str | int) -> ModelVersion:
        return ModelVersion.model_validate(self._transport.json("DELETE", _version_path(name, version)))

    def predict(
        self, name: str, images: Sequence[str | Path], *, version: str | int = "latest", top_k: int = 3
    ) -> list[dict[str, Any]]:
        """Score image files with a registered model: per image, ``{"file", "top": [{"label",
        "probability"}, ...]}`` in the order given (sent in batches of :data:`PREDICT_BATCH`)."""
        out: list[dict[str, Any]] = []
        paths = [Path(p) for p in images]
        for start in range(0, len(paths), PREDICT_BATCH):
            chunk = paths[start : start + PREDICT_BATCH]
            files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in chunk]
            body = self._transport.json(
                "POST", f"{_version_path(name, version)}/predict", files=files, data={"top_k": str(top_k)}
            )
            for path, prediction in zip(chunk, body["predictions"], strict=True):
                out.append({**prediction, "file": str(path)})
        return out

    def download_onnx(self, path: str, dest: str | Path) -> Path:
        """Save the ONNX export at API ``path`` to ``dest`` (written atomically)."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as fh, self._transport.stream("GET", path) as response:
                for chunk in response.iter_bytes():
                    fh.write(chunk)
            # mkstemp makes the file 0600; a download is an ordinary file (as the model
            # directory's files are): 0644 less the umask.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dest

    def download_version_onnx(self, name: str, version: str | int, dest: str | Path) -> Path:
        return self.download_onnx(f"{_version_path(name, version)}/onnx", dest)

    def download_job_onnx(self, job_id: str, dest: str | Path) -> Path:
        return self.download_onnx(f"/v1/jobs/{segment(job_id)}/model/onnx", dest)
