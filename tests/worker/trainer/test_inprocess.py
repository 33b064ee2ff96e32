"""Whole trainer runs as a one-rank job inside the test process: determinism, resume, failures."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.trainer_helpers import (
    Digits,
    epoch_history,
    metric_values,
    read_events,
    read_failure,
    run_in_process,
    single_process_env,
    subset_classes,
    write_job,
)
from torchyard import modeldir
from worker.trainer import checkpoint as ckpt
from worker.trainer import runner
from worker.trainer.control import PREEMPT_REQUEST_FILE, PREEMPTED_FILE

THREE = ["0", "1", "2"]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_process")]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, digits: Digits) -> Path:
    """An uninterrupted 2-epoch run (seed 7) that other tests compare against."""
    out = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp, single_process_env(mp):
        assert run_in_process(write_job(out, digits, random_seed=7, warmup_epochs=1)) == 0
    return out


def test_same_seed_gives_identical_metrics(tmp_path: Path, digits: Digits, reference_run: Path) -> None:
    assert run_in_process(write_job(tmp_path, digits, random_seed=7, warmup_epochs=1)) == 0
    first, second = epoch_history(reference_run), epoch_history(tmp_path)
    assert len(first) == 2
    assert first == second  # exact: same seed, data and world size on the CPU
    weights = [modeldir.load_state(run / "model") for run in (reference_run, tmp_path)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_first_epoch_validates_with_batchnorm_statistics_of_its_weights(reference_run: Path) -> None:
    # BatchNorm's moving averages lag the fast last steps of a warm-up: validated with them,
    # this run's first epoch scored a loss of 28 and a top-1 of 10 % (chance: 2.3 and 10 %)
    # where its training loss was 2.0. The statistics recomputed for the epoch's weights
    # (worker/trainer/batchnorm.py) give about 1.2 and 57 %, and the curve falls from there.
    first, second = epoch_history(reference_run)
    assert first["val.loss"] < math.log(10) and first["val.top1"] > 0.3, first
    assert second["val.loss"] < first["val.loss"]


def test_a_resumed_run_continues_from_the_checkpoint(
    tmp_path: Path,
    digits: Digits,
    reference_run: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = write_job(tmp_path, digits, random_seed=7, warmup_epochs=1)
    steps_per_epoch = 240 // 16
    # The first attempt dies at the first iteration of epoch 2, after checkpoint.pt of epoch 1.
    monkeypatch.setenv("TORCHYARD_TEST_FAIL_RANK", "0")
    monkeypatch.setenv("TORCHYARD_TEST_FAIL_STEP", str(steps_per_epoch))
    assert run_in_process(job) == 1
    failure = read_failure(tmp_path, 0)
    assert failure["code"] == "RankFailedError" and "injected failure" in failure["message"]
    assert (tmp_path / "checkpoint.pt").is_file() and not (tmp_path / "model").exists()
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 1 and checkpoint["step"] == steps_per_epoch
    assert not any(k.startswith("module.") for k in checkpoint["model"])

    monkeypatch.delenv("TORCHYARD_TEST_FAIL_RANK")
    monkeypatch.delenv("TORCHYARD_TEST_FAIL_STEP")
    (tmp_path / "failure-rank-0.json").unlink()
    assert run_in_process(job) == 0
    # The resumed attempt trains epoch 2 only and ends exactly where the uninterrupted run did.
    assert epoch_history(tmp_path) == epoch_history(reference_run)
    val_epochs = [e["epoch"] for e in metric_values(read_events(tmp_path), "val.loss")]
    assert val_epochs == [1, 2]
    modeldir.verify_model_dir(tmp_path / "model")


def test_unknown_architecture_writes_a_failure_file(tmp_path: Path, digits: Digits) -> None:
    assert run_in_process(write_job(tmp_path, digits, architecture="resnet1000")) == 1
    failure = read_failure(tmp_path, 0)
    assert failure["code"] == "InvalidModelDirectoryError"
    assert "resnet1000" in failure["message"]
    assert failure["rank"] == 0 and failure["node"] == "test-node"
    assert not (tmp_path / "model").exists()


def test_missing_class_folder_is_a_dataset_failure(tmp_path: Path, digits: Digits) -> None:
    train = subset_classes(digits.train, tmp_path / "train", ["0", "1"])
    job = write_job(tmp_path / "run", Digits(train, digits.val), classes=["0", "1", "2"])
    assert run_in_process(job) == 1
    failure = read_failure(tmp_path / "run", 0)
    assert failure["code"] == "InvalidDatasetError" and "['2']" in failure["message"]


@pytest.fixture(scope="module")
def three_digits(tmp_path_factory: pytest.TempPathFactory, digits: Digits) -> Digits:
    """Digits 0, 1 and 2 only: a smaller job with fewer classes."""
    root = tmp_path_factory.mktemp("three-digits")
    return Digits(
        subset_classes(digits.train, root / "train", THREE),
        subset_classes(digits.val, root / "val", THREE),
    )


def test_fine_tuning_with_fewer_classes(tmp_path: Path, three_digits: Digits, reference_run: Path) -> None:
    classes = THREE
    out = tmp_path / "run"
    job = write_job(out, three_digits, classes=classes, init_from_dir=reference_run / "model", epochs=1)
    assert run_in_process(job) == 0
    model, names, config = modeldir.load_model(out / "model")
    assert names == classes and config["num_classes"] == 3 and model.get_submodule("fc").out_features == 3
    assert config["initialized_from"].startswith("init_from:")
    assert json.loads((out / "model" / "metrics.json").read_text())["epochs_run"] == 1
    assert "val.top5" not in config and not metric_values(
        read_events(out), "val.top5"
    )  # fewer than 5 classes


def test_early_stopping_publishes_the_best_epoch(
    tmp_path: Path, three_digits: Digits, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted = iter([1.0, 1.5, 1.2])  # epoch 1 is the best; two epochs without improvement follow
    real_validate = runner.validate

    def validate(*args: Any, **kwargs: Any) -> dict[str, float]:
        return {**real_validate(*args, **kwargs), "val.loss": next(scripted)}

    monkeypatch.setattr(runner, "validate", validate)
    assert run_in_process(write_job(tmp_path, three_digits, classes=THREE, epochs=5, patience=2)) == 0
    result = read_events(tmp_path)[-1]
    assert result["type"] == "result"
    assert (result["best_epoch"], result["epochs_run"], result["stopped_early"]) == (1, 3, True)
    assert result["best"]["val.loss"] == 1.0
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (config["best_epoch"], config["stopped_early"], config["epochs_run"]) == (1, True, 3)
    # model.safetensors holds epoch 1's weights, not the last epoch's.
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 3 and checkpoint["best_epoch"] == 1 and checkpoint["stopped"] is True
    published = modeldir.load_state(tmp_path / "model")
    assert all(torch.equal(published[k], checkpoint["best_model"][k]) for k in published)
    assert not torch.equal(published["fc.weight"], checkpoint["model"]["fc.weight"])


def _handed_over(caplog: pytest.LogCaptureFixture) -> list[str]:
    marks = [r.getMessage() for r in caplog.records if "handed to the writer" in r.getMessage()]
    caplog.clear()
    return [m.split(" handed")[0].removeprefix("checkpoint after ") for m in marks]


def _preempt_when_paused(run_dir: Path, point: str) -> threading.Thread:
    """Play the agent: once rank 0 waits at ``point``, ask for a preemption and let it go on."""

    def run() -> None:
        marker = run_dir / f"paused-{point}"
        deadline = time.monotonic() + 300
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        (run_dir / PREEMPT_REQUEST_FILE).write_text("")
        marker.unlink()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_checkpoints_spaced_by_the_interval_still_resume_exactly(
    tmp_path: Path, digits: Digits, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With an interval longer than the run, only the first epoch end of each attempt, a
    preemption and the last epoch get a checkpoint; a failure then redoes the epochs
    since the last one, and the job still ends with the uninterrupted run's metrics."""
    settings = {"architecture": "squeezenet1_1", "epochs": 4, "random_seed": 3}
    reference = tmp_path / "reference"
    assert run_in_process(write_job(reference, digits, **settings)) == 0
    caplog.clear()

    run = tmp_path / "run"
    job = write_job(run, digits, **settings)
    monkeypatch.setenv(ckpt.INTERVAL_VAR, "3600")
    steps_per_epoch = 240 // 16
    # Attempt 1 fails at the first step of epoch 3: epoch 2 got no checkpoint.
    monkeypatch.setenv("TORCHYARD_TEST_FAIL_RANK", "0")
    monkeypatch.setenv("TORCHYARD_TEST_FAIL_STEP", str(2 * steps_per_epoch))
    assert run_in_process(job) == 1
    assert _handed_over(caplog) == ["epoch 1"]
    assert torch.load(run / ckpt.CHECKPOINT_FILE, weights_only=True)["epoch"] == 1
    monkeypatch.delenv("TORCHYARD_TEST_FAIL_RANK")
    monkeypatch.delenv("TORCHYARD_TEST_FAIL_STEP")
    (run / "failure-rank-0.json").unlink()

    # Attempt 2 resumes after epoch 1 and is preempted before epoch 3's validation: epoch 2
    # (its first) and epoch 3 (the preemption) get one, however short the time between.
    monkeypatch.setenv("TORCHYARD_TEST_PAUSE_AT", "validation:3")
    agent = _preempt_when_paused(run, "validation-3")
    assert run_in_process(job) == 0
    agent.join(5)
    assert _handed_over(caplog) == ["epoch 2", "epoch 3"]
    assert json.loads((run / PREEMPTED_FILE).read_text())["epoch"] == 3
    assert not (run / "model").exists()
    monkeypatch.delenv("TORCHYARD_TEST_PAUSE_AT")
    (run / PREEMPT_REQUEST_FILE).unlink()

    # Attempt 3 trains the last epoch, whose checkpoint is always written.
    assert run_in_process(job) == 0
    assert _handed_over(caplog) == ["epoch 4"]
    assert epoch_history(run) == epoch_history(reference)
