"""``torchyard compare`` as text: within the terminal's width, only quality metrics ranked
(accuracies highest, losses lowest; time, learning rate and throughput not), and datasets
by name (tests/service/test_compare.py runs it against the API)."""

from __future__ import annotations

from typing import Any

import pytest

from torchyard.client import JobComparison
from torchyard.commands.metrics import comparison_text, quality_goal

METRICS = [
    "epoch.seconds",
    "train.images_per_sec",
    "train.loss",
    "train.lr",
    "val.loss",
    "val.top1",
    "val.top5",
]
TRAIN_A, TRAIN_B, VAL = "1" * 32, "2" * 32, "3" * 32


def _metric(best: float, epoch: int, final: float) -> dict[str, Any]:
    return {
        "best": {"value": best, "epoch": epoch, "step": 10},
        "final": {"value": final, "epoch": 3, "step": 30},
    }


def _comparison(jobs: int = 3) -> JobComparison:
    return JobComparison.model_validate(
        {
            "jobs": [
                {
                    "id": f"{i}" * 32,
                    "name": f"digits-resnet18-{i}",
                    "status": "succeeded",
                    "duration_s": 100.0 + i,
                    "images_per_sec": 250.0,
                    "parameters": {
                        "parameters.learning_rate": 0.01 * (i + 1),
                        "train_dataset": TRAIN_A if i % 2 == 0 else TRAIN_B,
                        "validation_dataset": VAL,
                    },
                    "metrics": {name: _metric(0.5 + i / 10, 2, 0.4 + i / 10) for name in METRICS},
                }
                for i in range(jobs)
            ],
            "metrics": METRICS,
            # The service's ``goals``: every metric one way or the other.
            "goals": {name: "min" if name.endswith("loss") else "max" for name in METRICS},
            "differing": ["parameters.learning_rate", "train_dataset"],
        }
    )


@pytest.mark.parametrize("width", [80, 100, 120])
def test_it_fits_the_width_it_is_given(width: int) -> None:
    text = comparison_text(_comparison(), width=width)
    assert max(len(line) for line in text.splitlines()) <= width, text
    # Every value is still there, one row per metric and job below the jobs.
    assert "0.7 (epoch 2)" in text and "digits-resnet18-2" in text


def test_the_default_width_is_the_terminals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "90")
    text = comparison_text(_comparison())
    assert max(len(line) for line in text.splitlines()) <= 90
    monkeypatch.setenv("COLUMNS", "400")
    wide = comparison_text(_comparison())
    header = next(line for line in wide.splitlines() if line.startswith("JOB"))
    assert "val.top1 BEST (max)" in header and "val.loss BEST (min)" in header  # beside the jobs


def test_only_quality_metrics_are_ranked() -> None:
    assert [quality_goal(name) for name in METRICS] == [None, None, "min", None, "min", "max", "max"]
    assert quality_goal("val.accuracy") == "max" and quality_goal("eval_loss") == "min"
    # A script's names: MLflow's, TensorBoard's, Lightning's.
    assert [quality_goal(n) for n in ("val/acc", "Loss/train", "train_loss_step", "val_acc_epoch")] == [
        "max",
        "min",
        "min",
        "max",
    ]
    assert quality_goal("loss_scale") is None and quality_goal("lr-Adam") is None
    wide = comparison_text(_comparison(), width=400)
    header = next(line for line in wide.splitlines() if line.startswith("JOB"))
    for name in ("epoch.seconds", "train.lr", "train.images_per_sec"):
        assert f"{name} BEST" not in header and f"{name} FINAL" in header
    # The ranked metrics come first.
    assert header.index("train.loss BEST (min)") < header.index("epoch.seconds FINAL")
    narrow = comparison_text(_comparison(), width=80).splitlines()
    ranked = [line for line in narrow if line.startswith(("val.top1", "train.lr", "epoch.seconds"))]
    assert [line.split()[:2] for line in ranked] == [
        ["val.top1", "(max)"],
        ["epoch.seconds", "00000000"],
        ["train.lr", "00000000"],
    ]
    lr = next(line for line in narrow if line.startswith("train.lr"))
    assert lr.split() == ["train.lr", "00000000", "0.4"]  # the final value alone: no best


def test_datasets_are_named() -> None:
    names = {TRAIN_A: "digits-train", TRAIN_B: "digits-train-v2"}
    lines = comparison_text(_comparison(2), width=120, datasets=names).splitlines()
    row = next(line for line in lines if line.startswith("train_dataset"))
    assert row.split() == ["train_dataset", "digits-train", "digits-train-v2"]
    # Two datasets of one name: the start of their ids tells them apart.
    same = {TRAIN_A: "digits-train", TRAIN_B: "digits-train"}
    lines = comparison_text(_comparison(2), width=120, datasets=same).splitlines()
    row = next(line for line in lines if line.startswith("train_dataset"))
    assert row.split() == [
        "train_dataset",
        "digits-train",
        f"({TRAIN_A[:8]})",
        "digits-train",
        f"({TRAIN_B[:8]})",
    ]
    # A dataset it could not name (deleted): its id.
    lines = comparison_text(_comparison(2), width=120, datasets={TRAIN_A: "digits-train"}).splitlines()
    row = next(line for line in lines if line.startswith("train_dataset"))
    assert row.split() == ["train_dataset", "digits-train", TRAIN_B]


def test_many_jobs_give_a_row_per_parameter_and_job() -> None:
    text = comparison_text(_comparison(12), width=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert lines[0].split() == ["PARAMETER", "JOB", "VALUE"]
    assert lines[1].split() == ["parameters.learning_rate", "00000000", "0.01"]
    assert lines[2].split() == ["11111111", "0.02"]


def test_a_job_without_epochs_has_its_best_at_a_step_and_logged_params_are_rows() -> None:
    data = _comparison(2).model_dump()
    steps = {
        "best": {"value": 0.83, "epoch": 0, "step": 400},
        "final": {"value": 0.8, "epoch": 0, "step": 500},
    }
    data["jobs"][1].update(type="script", metrics={"val.top1": steps}, logged={"mlflow: lr": "0.1"})
    data["logged_differing"] = ["mlflow: lr"]
    # The service says how each job counts; an older one does not: a script whose points
    # are all at epoch 0 counts steps.
    for axis in ("step", None):
        data["jobs"][1]["axis"] = axis
        text = comparison_text(JobComparison.model_validate(data), width=400)
        assert "0.83 (step 400)" in text and "0.5 (epoch 2)" in text, text
        row = next(line for line in text.splitlines() if line.startswith("mlflow: lr"))
        assert row.split() == ["mlflow:", "lr", "-", "0.1"]
