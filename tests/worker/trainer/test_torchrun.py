"""Real ``torchrun --nproc-per-node 2`` runs of the trainer, launched as the worker agent does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.trainer_helpers import (
    Digits,
    metric_values,
    read_events,
    read_failure,
    run_torchrun,
    write_job,
)
from torchyard import modeldir

pytestmark = pytest.mark.slow

METRICS = (
    "train.loss",
    "train.lr",
    "train.images_per_sec",
    "val.loss",
    "val.top1",
    "val.top5",
    "epoch.seconds",
)


def test_two_process_run_publishes_a_reproducible_model(tmp_path: Path, digits: Digits) -> None:
    job = write_job(
        tmp_path,
        digits,
        epochs=2,
        warmup_epochs=1,
        learning_rate=0.02,
        print_frequency=3,
        loader_workers=None,
    )
    result = run_torchrun(job, nproc=2)
    assert result.returncode == 0, result.output[-4000:]
    assert "[rank 1]" in result.output and "job configuration" in result.output

    events = read_events(tmp_path)
    for name in METRICS:
        assert metric_values(events, name), f"no {name} metric"
    for event in (e for e in events if e["type"] == "metric"):
        assert event["rank"] == 0 and math.isfinite(event["value"]) and event["time"] > 0
    steps_per_epoch = 240 // (2 * 16)  # 240 training images over 2 ranks, batches of 16, last one dropped
    total = 2 * steps_per_epoch
    assert [e["epoch"] for e in metric_values(events, "val.loss")] == [1, 2]
    assert [e["step"] for e in metric_values(events, "val.loss")] == [steps_per_epoch, total]
    assert [e["step"] for e in metric_values(events, "train.loss")] == [3, 6, 7, 9, 12, 14]
    assert all(
        0 <= e["value"] <= 1 for e in metric_values(events, "val.top1") + metric_values(events, "val.top5")
    )
    lrs = [e["value"] for e in metric_values(events, "train.lr")]
    assert max(lrs) == pytest.approx(0.02 * 2)  # learning_rate x world size, reached at the end of warm-up
    assert lrs[-1] == pytest.approx(0.04 / steps_per_epoch)  # the last iteration's rate, one step from 0
    assert all(e["value"] > 0 for e in metric_values(events, "train.images_per_sec"))
    progress = [e for e in events if e["type"] == "progress"]
    assert progress[-1]["step"] == progress[-1]["total_steps"] == total and progress[-1]["epochs"] == 2

    result_event = events[-1]
    assert result_event["type"] == "result"
    assert result_event["epochs_run"] == 2 and result_event["stopped_early"] is False
    best_epoch = result_event["best_epoch"]
    val_losses = {e["epoch"]: e["value"] for e in metric_values(events, "val.loss")}
    assert best_epoch == min(val_losses, key=lambda epoch: val_losses[epoch])
    assert result_event["best"]["val.loss"] == val_losses[best_epoch]

    model_dir = tmp_path / "model"
    modeldir.verify_model_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["world_size"] == 2 and config["best_epoch"] == best_epoch
    assert config["classes"] == [str(i) for i in range(10)] and config["image_size"] == 32
    assert config["datasets"]["train"] == {"id": "ds-train", "sha256": "0" * 64}
    assert config["parameters"]["learning_rate"] == 0.02 and config["augmentation"] == "light"
    assert config["torch_version"] and config["torchvision_version"]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2] and metrics["best"] == result_event["best"]

    # The downloaded model reproduces the reported validation accuracy of its best epoch.
    report = modeldir.evaluate_dir(model_dir, digits.val)
    assert report["n"] == 60
    assert abs(report["correct"] - result_event["best"]["val.top1"] * 60) <= 1
    assert not list(tmp_path.glob("failure-rank-*.json"))
    assert not list(tmp_path.glob("*.tmp-*"))


def test_diverging_loss_fails_with_advice(tmp_path: Path, digits: Digits) -> None:
    job = write_job(tmp_path, digits, learning_rate=1e6, epochs=1)
    result = run_torchrun(job, nproc=2, timeout=120)
    assert result.returncode != 0
    failures = sorted(tmp_path.glob("failure-rank-*.json"))
    assert failures, result.output[-4000:]
    for path in failures:
        failure = json.loads(path.read_text())
        if failure["secondary"]:
            continue
        assert failure["code"] == "TrainingDivergedError"
        assert "Lower the learning rate" in failure["message"] and "1e+06" in failure["message"]
        assert failure["node"] == "test-node"
    assert any(not json.loads(p.read_text())["secondary"] for p in failures)
    assert not (tmp_path / "model").exists()


def test_a_failing_rank_does_not_hang_its_peer(tmp_path: Path, digits: Digits) -> None:
    job = write_job(tmp_path, digits, epochs=1)
    result = run_torchrun(
        job, nproc=2, env={"TORCHYARD_TEST_FAIL_RANK": "1", "TORCHYARD_PG_TIMEOUT_S": "30"}, timeout=120
    )
    assert result.returncode != 0
    assert result.seconds < 90, "the surviving rank waited too long"
    failure = read_failure(tmp_path, 1)
    assert failure["code"] == "RankFailedError" and failure["rank"] == 1 and failure["local_rank"] == 1
    assert failure["message"].startswith("RuntimeError: injected failure")
    assert "Traceback (most recent call last)" in failure["traceback"] and "check" in failure["traceback"]
    assert failure["node"] == "test-node" and failure["secondary"] is False
    rank0 = tmp_path / "failure-rank-0.json"
    if rank0.exists():  # rank 0 may see the broken collective before torchrun stops it
        assert json.loads(rank0.read_text())["secondary"] is True
    assert not (tmp_path / "model").exists()
