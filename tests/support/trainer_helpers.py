"""Helpers for the trainer tests: small datasets, job.json files, trainer runs (in-process and torchrun)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import REPO_ROOT
from worker.trainer.cli import main as trainer_main

DIGIT_CLASSES = [str(i) for i in range(10)]
# Variables of an enclosing torchrun (or an earlier test) that must not leak into a run.
_DIST_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHYARD_TEST_FAIL_RANK",
    "TORCHYARD_TEST_FAIL_STEP",
)


@dataclass(frozen=True)
class Digits:
    train: Path
    val: Path


@contextlib.contextmanager
def single_process_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHYARD_NODE_NAME", "test-node")
    monkeypatch.setenv("TORCHYARD_DEVICE", "cpu")
    # One compute thread: the trainer applies OMP_NUM_THREADS, and spinning OpenMP threads
    # make timings erratic on a small, shared CI machine. Restored for the other tests.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def subset_classes(source: Path, dest: Path, classes: list[str]) -> Path:
    """Copy some class folders of an ImageDirectory (for jobs with fewer classes)."""
    for name in classes:
        shutil.copytree(source / name, dest / name)
    return dest


def write_job(
    output_dir: Path,
    data: Digits,
    *,
    classes: list[str] | None = None,
    architecture: str = "resnet18",
    pretrained: bool = False,
    init_from_dir: Path | None = None,
    loader_workers: int | None = 0,
    **parameters: Any,
) -> Path:
    """Write ``output_dir/job.json`` as the agent does; small-data defaults for the parameters."""
    output_dir.mkdir(parents=True, exist_ok=True)
    params: dict[str, Any] = {
        "epochs": 2,
        "batch_size": 16,
        "warmup_epochs": 0,
        "learning_rate": 0.01,
        "random_seed": 1,
        "patience": 3,
        "print_frequency": 5,
        "image_size": 32,
        "augmentation": "light",
    }
    params.update(parameters)
    job = {
        "job_id": "job-" + output_dir.name,
        "attempt_id": "attempt-1",
        "model": {"architecture": architecture, "pretrained": pretrained, "memory_efficient": False},
        "init_from_dir": str(init_from_dir) if init_from_dir else None,
        "parameters": params,
        "train_dir": str(data.train),
        "val_dir": str(data.val),
        "classes": classes or DIGIT_CLASSES,
        "datasets": {
            "train": {"id": "ds-train", "sha256": "0" * 64},
            "validation": {"id": "ds-val", "sha256": "1" * 64},
        },
        "output_dir": str(output_dir),
        "loader_workers": loader_workers,
    }
    path = output_dir / "job.json"
    path.write_text(json.dumps(job, indent=2), encoding="utf-8")
    return path


def run_in_process(job_path: Path) -> int:
    """Run the trainer as a one-rank job inside the test process (use with ``single_process``)."""
    return trainer_main(["--config", str(job_path)])


@dataclass
class TorchrunResult:
    returncode: int
    output: str
    seconds: float


def run_torchrun(
    job_path: Path, *, nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 180
) -> TorchrunResult:
    """Start ``torchrun --standalone --nproc-per-node N -m worker.trainer`` as the agent would."""
    child_env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    child_env.update(
        {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
            "TORCHYARD_NODE_NAME": "test-node",
            "TORCHYARD_DEVICE": "cpu",
            "PYTHONUNBUFFERED": "1",
        }
    )
    child_env.update(env or {})
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "worker.trainer",
        "--config",
        str(job_path),
    ]
    started = time.monotonic()
    proc = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    return TorchrunResult(proc.returncode, proc.stdout, time.monotonic() - started)


def read_events(output_dir: Path) -> list[dict[str, Any]]:
    lines = (output_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def metric_values(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "metric" and e["name"] == name]


def epoch_history(output_dir: Path) -> list[dict[str, Any]]:
    """Per-epoch metrics of a finished run (from the model directory), without timings."""
    metrics = json.loads((output_dir / "model" / "metrics.json").read_text(encoding="utf-8"))
    timing = {"train.images_per_sec", "epoch.seconds"}
    return [{k: v for k, v in entry.items() if k not in timing} for entry in metrics["history"]]


def read_failure(output_dir: Path, rank: int) -> dict[str, Any]:
    return json.loads((output_dir / f"failure-rank-{rank}.json").read_text(encoding="utf-8"))
