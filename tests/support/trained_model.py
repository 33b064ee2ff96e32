"""One small model trained in-process for the whole run (the models API, scoring, ONNX and
the web UI's models page all use it): a resnet18 on 32 px digits, 2 epochs, with its ONNX
export, packed as a job would upload it, and held-out digits neither training nor
validation saw. Under pytest-xdist the first test process that needs it trains it in the
run's shared temporary folder; the others read what it wrote (:func:`shared_trained_model`)."""

from __future__ import annotations

import fcntl
import json
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


_DONE = "trained.json"


def shared_trained_model(root: Path) -> Trained:
    """The model of :func:`train_small_model` in ``root``, trained by the first caller: every
    test process of a run calls this with the same folder, and each after the first (waiting on
    the folder's lock while the first trains) reads the description it left."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = root / _DONE
        if done.is_file():
            saved = json.loads(done.read_text())
            return Trained(
                model_dir=Path(saved["model_dir"]),
                archive=Path(saved["archive"]),
                sha256=saved["sha256"],
                held_out=[Path(p) for p in saved["held_out"]],
                labels=saved["labels"],
                val_dir=Path(saved["val_dir"]),
            )
        trained = train_small_model(root / "model")
        saved = {
            "model_dir": str(trained.model_dir),
            "archive": str(trained.archive),
            "sha256": trained.sha256,
            "held_out": [str(p) for p in trained.held_out],
            "labels": trained.labels,
            "val_dir": str(trained.val_dir),
        }
        done.write_text(json.dumps(saved))
        return trained
