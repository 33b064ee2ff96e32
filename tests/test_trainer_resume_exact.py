"""Exact resume with real ``torchrun`` processes (2 ranks, CPU): a run SIGKILLed at a known
point (mid-epoch, during validation, while writing its checkpoint) or preempted at a step
boundary, then resumed from its checkpoint, ends with the per-epoch validation metrics of
the run that was never interrupted."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.trainer_helpers import (  # noqa: F401 - fixture
    REPO_ROOT,
    Digits,
    digits_fixture,
    epoch_history,
    run_torchrun,
    write_job,
)
from worker.agent.launcher import MARKER_VAR, marked_pids
from worker.trainer import checkpoint as ckpt
from worker.trainer.control import PREEMPT_REQUEST_FILE, PREEMPTED_FILE

pytestmark = pytest.mark.slow

EPOCHS = 2
STEPS_PER_EPOCH = 240 // (2 * 16)  # 240 training images over 2 ranks, batches of 16, last one dropped


def _job(output_dir: Path, digits: Digits) -> Path:
    # Same job id for every run: a resumed run must accept the checkpoint as its own.
    path = write_job(output_dir, digits, epochs=EPOCHS, learning_rate=0.02, loader_workers=1)
    text = path.read_text().replace(f'"job-{output_dir.name}"', '"job-resume"')
    path.write_text(text)
    return path


@pytest.fixture(scope="module", name="reference")
def reference_fixture(tmp_path_factory: pytest.TempPathFactory, digits: Digits) -> list[dict[str, float]]:
    """The uninterrupted run's per-epoch history."""
    out = tmp_path_factory.mktemp("reference")
    result = run_torchrun(_job(out, digits))
    assert result.returncode == 0, result.output[-4000:]
    return epoch_history(out)


def _start_paused(job: Path, pause_at: str) -> tuple[subprocess.Popen[bytes], str]:
    marker = "resume-test/" + secrets.token_hex(6)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(
        {
            "PYTHONPATH": str(REPO_ROOT),
            "OMP_NUM_THREADS": "1",
            "TORCHYARD_NODE_NAME": "test-node",
            "TORCHYARD_DEVICE": "cpu",
            "TORCHYARD_TEST_PAUSE_AT": pause_at,
            MARKER_VAR: marker,
        }
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*command, "-m", "worker.trainer", "--config", str(job)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, marker


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.1)


def _kill_all(proc: subprocess.Popen[bytes], marker: str) -> None:
    """SIGKILL torchrun and every rank (and loader worker) of the run."""
    pids = [proc.pid, *marked_pids(marker)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not marked_pids(marker)


def _assert_same(resumed: list[dict[str, float]], reference: list[dict[str, float]]) -> None:
    assert [h["epoch"] for h in resumed] == [h["epoch"] for h in reference]
    for got, want in zip(resumed, reference, strict=True):
        assert got["val.top1"] == want["val.top1"], (got, want)
        assert abs(got["val.loss"] - want["val.loss"]) <= 1e-6, (got, want)


@pytest.mark.parametrize(
    ("pause_at", "resumes_after"),
    [
        ("train:2", 1),  # mid-epoch 2: the checkpoint of epoch 1 is the latest
        ("validation:2", 1),  # epoch 2 trained, validation under way
        ("checkpoint:2", 1),  # epoch 2's checkpoint written to its temporary file, not yet renamed
    ],
)
def test_killed_run_resumes_exactly(
    tmp_path: Path, digits: Digits, reference: list[dict[str, float]], pause_at: str, resumes_after: int
) -> None:
    job = _job(tmp_path, digits)
    proc, marker = _start_paused(job, pause_at)
    point, epoch = pause_at.split(":")
    _wait_for(tmp_path / f"paused-{point}-{epoch}", proc)
    _kill_all(proc, marker)

    # What the kill left: the last complete checkpoint, never a torn one.
    state = torch.load(tmp_path / ckpt.CHECKPOINT_FILE, weights_only=True)
    assert state["epoch"] == resumes_after and state["step_in_epoch"] == 0
    assert len(state["rank_states"]) == 2

    (tmp_path / f"paused-{point}-{epoch}").unlink()
    result = run_torchrun(job)
    assert result.returncode == 0, result.output[-4000:]
    assert f"resuming after epoch {resumes_after}" in result.output
    _assert_same(epoch_history(tmp_path), reference)


def test_preempted_run_checkpoints_mid_epoch_and_continues_exactly(
    tmp_path: Path, digits: Digits, reference: list[dict[str, float]]
) -> None:
    job = _job(tmp_path, digits)
    proc, _marker = _start_paused(job, "train:2")
    paused = tmp_path / "paused-train-2"
    _wait_for(paused, proc)
    # The agent's preemption request arrives while rank 0 is at step 3 of epoch 2; the
    # other rank is blocked in the next collective. Let rank 0 go on.
    (tmp_path / PREEMPT_REQUEST_FILE).write_text("")
    paused.unlink()
    assert proc.wait(120) == 0

    stop = STEPS_PER_EPOCH // 2
    state = torch.load(tmp_path / ckpt.CHECKPOINT_FILE, weights_only=True)
    assert state["epoch"] == 1 and state["step_in_epoch"] == stop
    assert state["step"] == STEPS_PER_EPOCH + stop and state["sampler_epoch"] == 2
    assert len(state["rank_states"]) == 2
    # Each rank's own random state: the two differ.
    assert not torch.equal(state["rank_states"][0]["rng"]["torch"], state["rank_states"][1]["rng"]["torch"])
    assert (tmp_path / PREEMPTED_FILE).is_file() and not (tmp_path / "model").exists()

    (tmp_path / PREEMPT_REQUEST_FILE).unlink()
    result = run_torchrun(job)
    assert result.returncode == 0, result.output[-4000:]
    assert f"resuming epoch 2 at batch {stop + 1}" in result.output
    _assert_same(epoch_history(tmp_path), reference)
