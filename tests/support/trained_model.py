"""One small model trained in-process for the whole session (the models API, scoring, ONNX and
the web UI's models page all use it): a resnet18 on 32 px digits, 2 epochs, with its ONNX
export, packed as a job would upload it, and held-out digits neither training nor
validation saw."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.trainer_helpers import Digits, run_in_process, single_process_env, write_job
from torchyard.contract.model_archive import pack_model_dir
from torchyard.sample_data import write_digits


@dataclass(frozen=True)
class Trained:
    model_dir: Path
    archive: Path
    sha256: str
    held_out: list[Path]
    labels: list[str]
    val_dir: Path


def _held_out(root: Path, used: Digits) -> list[Path]:
    """Digits of the same shuffle that neither training nor validation saw."""
    seen = {p.name for p in used.train.rglob("*.png")} | {p.name for p in used.val.rglob("*.png")}
    more_train, more_val = write_digits(root, per_class=45, size=32)
    files = sorted(more_train.rglob("*.png")) + sorted(more_val.rglob("*.png"))
    return [p for p in files if p.name not in seen]


def train_small_model(root: Path) -> Trained:
    train, val = write_digits(root / "digits", per_class=30, size=32)
    data = Digits(train, val)
    job = write_job(root / "run", data, epochs=2)
    with pytest.MonkeyPatch.context() as mp, single_process_env(mp):
        assert run_in_process(job) == 0
    held_out = _held_out(root / "more", data)
    assert len(held_out) >= 100
    model_dir = root / "run" / "model"
    sha256, _ = pack_model_dir(model_dir, root / "model.tar.gz")
    labels = [p.parent.name for p in held_out]
    return Trained(model_dir, root / "model.tar.gz", sha256, held_out, labels, val)
