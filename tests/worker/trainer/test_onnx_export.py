"""The trainer's ONNX export: kept when ONNX Runtime agrees with torch, dropped (never a
failed job) when it does not. A small squeezenet with random weights on real digits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from torchyard import modeldir
from torchyard.sample_data import write_digits
from torchyard.scoring import ONNX_TOLERANCE, OnnxModel
from worker.trainer import onnx_export

CLASSES = [str(i) for i in range(10)]


def _model(tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path]:
    torch.manual_seed(0)
    _, val = write_digits(tmp_path / "digits", per_class=3, size=32)
    config = {"architecture": "squeezenet1_1", "num_classes": 10, "classes": CLASSES, "image_size": 32}
    state = modeldir.build_architecture(config).state_dict()
    return state, config, val


def test_export_is_kept_within_the_tolerance_with_a_dynamic_batch(tmp_path: Path) -> None:
    state, config, val = _model(tmp_path)
    path, record = onnx_export.export_onnx(state, config, val, tmp_path)
    assert path is not None and path.is_file(), record
    assert record["file"] == "model.onnx" and 0 <= record["max_abs_diff"] <= ONNX_TOLERANCE
    (path.parent / "config.json").write_text(json.dumps({"classes": CLASSES, "image_size": 32}))
    served = OnnxModel.load(path.parent)
    model = modeldir.build_architecture(config)
    model.load_state_dict(state)
    model.eval()
    images = [modeldir.load_rgb_image(p) for p in sorted(val.rglob("*.png"))[:3]]
    inputs = served.preprocess(images)  # a batch size the export was not traced with
    with torch.inference_mode():
        expected = model(torch.from_numpy(inputs)).numpy()
    assert float(np.abs(served.logits(inputs) - expected).max()) <= ONNX_TOLERANCE


def test_export_over_the_tolerance_is_dropped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real difference above 1e-4 cannot be caused on purpose: a negative tolerance
    # makes any difference too large, which exercises the same path.
    monkeypatch.setattr(onnx_export, "ONNX_TOLERANCE", -1.0)
    state, config, val = _model(tmp_path)
    path, record = onnx_export.export_onnx(state, config, val, tmp_path)
    assert path is None and record["file"] is None
    assert "exceeds" in record["error"] and record["max_abs_diff"] >= 0
    assert not list(tmp_path.rglob("model.onnx"))


def test_an_export_that_fails_is_dropped(tmp_path: Path) -> None:
    state, config, val = _model(tmp_path)
    path, record = onnx_export.export_onnx(state, {**config, "num_classes": 3}, val, tmp_path)
    assert path is None and record["file"] is None and "Error" in record["error"]
