"""Exact resume with real ``torchrun`` processes (2 ranks, CPU): a run SIGKILLed at known
points (mid-epoch, during validation, while writing its checkpoint) and preempted at a
step boundary, resumed from its checkpoint each time, ends with the per-epoch validation
metrics of the run that was never interrupted."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.trainer_helpers import (
    REPO_ROOT,
    Digits,
    epoch_history,
    run_torchrun,
    write_job,
)
from worker.agent.marked_processes import MARKER_VAR, marked_pids
from worker.trainer import checkpoint as ckpt
from worker.trainer.control import PREEMPT_REQUEST_FILE, PREEMPTED_FILE

# Serial: in two runs of the suite with three and four test processes, one of this module's
# torchrun runs hung (a rank never reached a collective; bench/RESULTS.md, the test suite).
# Alone it has not: it runs after the parallel part until the hang is understood.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

EPOCHS = 2
STEPS_PER_EPOCH = 240 // (2 * 16)  # 240 training images over 2 ranks, batches of 16, last one dropped


def _job(output_dir: Path, digits: Digits) -> Path:
    # Same job id for every run: a resumed run must accept the checkpoint as its own.
    # SqueezeNet: small and fast, and its dropout draws from each rank's generator.
    path = write_job(
        output_dir, digits, architecture="squeezenet1_1", epochs=EPOCHS, learning_rate=0.02, loader_workers=1
    )
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


def _kill_at(tmp_path: Path, job: Path, pause_at: str) -> None:
    """Run until rank 0 reaches ``pause_at``, then SIGKILL every process of the run."""
    proc, marker = _start_paused(job, pause_at)
    point, epoch = pause_at.split(":")
    paused = tmp_path / f"paused-{point}-{epoch}"
    _wait_for(paused, proc)
    _kill_all(proc, marker)
    paused.unlink()


def _checkpoint(tmp_path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(tmp_path / ckpt.CHECKPOINT_FILE, weights_only=True)
    return state


def test_killed_and_preempted_run_resumes_exactly(
    tmp_path: Path, digits: Digits, reference: list[dict[str, float]]
) -> None:
    """One job, interrupted four times in epoch 2 and resumed each time: SIGKILL half-way
    through training, during validation, and with epoch 2's checkpoint written but not yet
    renamed; then a preemption at step 3, whose mid-epoch checkpoint the last attempt
    continues from. It ends with exactly the uninterrupted run's validation metrics."""
    job = _job(tmp_path, digits)
    _kill_at(tmp_path, job, "train:2")
    # Only complete checkpoints exist, the latest from epoch 1, with both ranks' states.
    state = _checkpoint(tmp_path)
    assert state["epoch"] == 1 and state["step_in_epoch"] == 0 and len(state["rank_states"]) == 2

    _kill_at(tmp_path, job, "validation:2")
    assert _checkpoint(tmp_path)["epoch"] == 1

    _kill_at(tmp_path, job, "checkpoint:2")
    # The torn write never replaced the file: still epoch 1; the temporary file is dead weight.
    assert _checkpoint(tmp_path)["epoch"] == 1
    for leftover in tmp_path.glob(".checkpoint.pt.tmp-*"):
        leftover.unlink()

    # Preemption: the agent's request arrives while rank 0 is at step 3 of epoch 2 (the
    # other rank waits in the next collective); the ranks stop after that same step.
    proc, _marker = _start_paused(job, "train:2")
    paused = tmp_path / "paused-train-2"
    _wait_for(paused, proc)
    (tmp_path / PREEMPT_REQUEST_FILE).write_text("")
    paused.unlink()
    assert proc.wait(180) == 0
    stop = STEPS_PER_EPOCH // 2
    state = _checkpoint(tmp_path)
    assert state["epoch"] == 1 and state["step_in_epoch"] == stop
    assert state["step"] == STEPS_PER_EPOCH + stop and state["sampler_epoch"] == 2
    # Each rank's own random state was gathered: the two differ.
    ranks = state["rank_states"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["rng"]["torch"], ranks[1]["rng"]["torch"])
    assert (tmp_path / PREEMPTED_FILE).is_file() and not (tmp_path / "model").exists()
    (tmp_path / PREEMPT_REQUEST_FILE).unlink()

    result = run_torchrun(job)
    assert result.returncode == 0, result.output[-4000:]
    assert f"resuming epoch 2 at batch {stop + 1}" in result.output
    _assert_same(epoch_history(tmp_path), reference)
