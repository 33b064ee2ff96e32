"""Whole trainer runs as a one-rank job inside the test process: determinism, resume, failures."""

from __future__ import annotations

import json
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
from worker.trainer import runner

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
