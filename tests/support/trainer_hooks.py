"""The test suite's trainer hooks (``TORCHYARD_TRAINER_HOOKS``, :mod:`worker.trainer.hooks`).

``tests/conftest.py`` names this file in the environment of every test process, so the
agents, torchrun and the ranks the tests start inherit it; the ranks load it by its path
(it imports nothing of the test suite). It acts only where a test sets one of:

* ``TORCHYARD_TEST_FAIL_RANK=<rank>``: that rank raises ``RuntimeError`` at its first
  training step, or at the job's step ``TORCHYARD_TEST_FAIL_STEP`` when that is set too;
* ``TORCHYARD_TEST_PAUSE_AT=<point>:<epoch>``: rank 0 writes ``paused-<point>-<epoch>`` in
  the run directory when it reaches ``point`` (``train``: half-way through the epoch,
  ``validation``, ``checkpoint``: the file written, not yet renamed; the background
  writer waits there, not training) in that epoch, and waits while that file exists, so a
  test can kill the processes or request a preemption at a known moment;
* ``TORCHYARD_BENCH_NO_CHECKPOINTS=1`` (``bench/bench_checkpoint.py``'s baseline): no
  checkpoint is written.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from worker.trainer.hooks import Hooks

log = logging.getLogger("worker.trainer.control")

FAIL_RANK_VAR = "TORCHYARD_TEST_FAIL_RANK"
FAIL_STEP_VAR = "TORCHYARD_TEST_FAIL_STEP"
PAUSE_AT_VAR = "TORCHYARD_TEST_PAUSE_AT"
NO_CHECKPOINTS_VAR = "TORCHYARD_BENCH_NO_CHECKPOINTS"


class TestHooks(Hooks):
    __test__ = False  # not a test class for pytest

    def __init__(self, rank: int, run_dir: Path) -> None:
        self.rank = rank
        self.run_dir = run_dir
        fail_rank = os.environ.get(FAIL_RANK_VAR, "").strip()
        fail_step = os.environ.get(FAIL_STEP_VAR, "").strip()
        self.armed = bool(fail_rank) and int(fail_rank) == rank
        self.fail_step = int(fail_step) if fail_step else None
        self.pause = _parse_pause(os.environ.get(PAUSE_AT_VAR, ""))
        self.checkpoints = os.environ.get(NO_CHECKPOINTS_VAR, "") != "1"

    def before_step(self, step: int) -> None:
        self.check(step)

    def check(self, step: int) -> None:
        """Fail here (the rank's traceback names this) at the step asked for."""
        if not self.armed:
            return
        if self.fail_step is None or step == self.fail_step:
            self.armed = False
            raise RuntimeError(f"injected failure ({FAIL_RANK_VAR}) at step {step}")

    def at_point(self, point: str, epoch: int) -> None:
        if self.rank != 0 or self.pause != (point, epoch):
            return
        marker = self.run_dir / f"paused-{point}-{epoch}"
        marker.write_text(str(os.getpid()), encoding="utf-8")
        log.warning("paused at %s of epoch %d (%s)", point, epoch, PAUSE_AT_VAR)
        while marker.exists():
            time.sleep(0.05)

    def writes_checkpoints(self) -> bool:
        if not self.checkpoints:
            log.warning("%s=1: no checkpoint is written", NO_CHECKPOINTS_VAR)
        return self.checkpoints


def trainer_hooks(rank: int, run_dir: Path) -> Hooks | None:
    hooks = TestHooks(rank, run_dir)
    acts = hooks.armed or hooks.pause is not None or not hooks.checkpoints
    return hooks if acts else None


def _parse_pause(raw: str) -> tuple[str, int] | None:
    point, sep, epoch = raw.strip().partition(":")
    if not sep or not epoch.isdigit():
        return None
    return point, int(epoch)
