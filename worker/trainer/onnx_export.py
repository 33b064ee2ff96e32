"""The ONNX export of the best model, checked against torch before it is kept.

Rank 0 exports the best epoch's weights with a dynamic batch dimension, runs the export
with ONNX Runtime on a validation batch (the validation transform, as serving applies
it) and compares the logits with torch's. The export is kept as ``model.onnx`` in the
model directory only when the largest absolute difference is at most
:data:`torchyard.scoring.ONNX_TOLERANCE`; otherwise, or if anything on the way fails
(an operator ONNX lacks, ONNX Runtime missing), it is dropped with a warning and the job
goes on: an export never fails a job. Either way ``config.json`` records what happened
under ``onnx``.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from torchyard import modeldir
from torchyard.scoring import ONNX_FILE, ONNX_TOLERANCE

log = logging.getLogger(__name__)

OPSET = modeldir.ONNX_OPSET
INPUT_NAME = modeldir.ONNX_INPUT
OUTPUT_NAME = modeldir.ONNX_OUTPUT
CHECK_BATCH = 8


def validation_batch(val_dir: str | Path, classes: list[str], config: dict[str, Any]) -> torch.Tensor:
    """Up to :data:`CHECK_BATCH` validation images, spread over the classes, as serving
    preprocesses them."""
    samples = modeldir.image_directory_samples(val_dir, classes)
    step = max(1, len(samples) // CHECK_BATCH)
    chosen = samples[::step][:CHECK_BATCH]
    transform = modeldir.eval_transform(config)
    return torch.stack([transform(modeldir.load_rgb_image(path)) for path, _ in chosen])


def _export(model: torch.nn.Module, example: torch.Tensor, dest: Path) -> None:
    modeldir.export_onnx(model, example, dest)


def _max_abs_diff(path: Path, model: torch.nn.Module, batch: torch.Tensor) -> float:
    return modeldir.onnx_max_abs_diff(path, model, batch)


def export_onnx(
    state: dict[str, torch.Tensor], config: dict[str, Any], val_dir: str | Path, work_dir: Path
) -> tuple[Path | None, dict[str, Any]]:
    """Export and check; ``(path of model.onnx or None, the record for config.json)``."""
    started = time.perf_counter()
    record: dict[str, Any] = {"file": None, "opset": OPSET, "tolerance": ONNX_TOLERANCE}
    dest = Path(tempfile.mkdtemp(prefix="onnx-", dir=work_dir)) / ONNX_FILE
    try:
        model = modeldir.build_architecture(config)
        model.load_state_dict(state, strict=True)
        model.eval()
        batch = validation_batch(val_dir, list(config["classes"]), config)
        _export(model, batch, dest)
        diff = _max_abs_diff(dest, model, batch)
    except Exception as exc:  # an export never fails the job
        log.warning("ONNX export dropped: %s: %s", type(exc).__name__, exc)
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
        dest.unlink(missing_ok=True)
        return None, record
    record["max_abs_diff"] = diff
    record["check_batch"] = int(batch.shape[0])
    if diff > ONNX_TOLERANCE:
        log.warning(
            "ONNX export dropped: ONNX Runtime's logits differ from torch's by %.3g (> %.0e)",
            diff,
            ONNX_TOLERANCE,
        )
        record["error"] = f"max abs difference {diff:.3g} exceeds {ONNX_TOLERANCE:g}"
        dest.unlink(missing_ok=True)
        return None, record
    record["file"] = ONNX_FILE
    log.info(
        "ONNX export checked: max abs difference %.2e on %d validation images (%.1fs)",
        diff,
        batch.shape[0],
        time.perf_counter() - started,
    )
    return dest, record
