"""What the worker agent and a rank tell each other through the run directory.

* ``preempt-request``: the agent asks the ranks to stop at the next step boundary and
  write a mid-epoch checkpoint (a drain or SIGTERM). Every rank looks for the file after
  each step and the ranks agree with one all-reduce of a stop flag, so all of them stop
  after the same step.
* ``progress-rank-<R>``: touched (at most once a second) when rank R finishes a training
  step or a validation batch; the agent's hang watchdog reads its modification time. The
  file holds the rank's pid, so the agent can signal it.
* ``preempted.json``: written by rank 0 after the preemption checkpoint (epoch, step).
* ``SIGUSR1`` makes a rank dump the Python stacks of all its threads into its log
  (``faulthandler``), for the hang watchdog.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PREEMPT_REQUEST_FILE = "preempt-request"
PREEMPTED_FILE = "preempted.json"
PROGRESS_PREFIX = "progress-rank-"
STACK_DUMP_SIGNAL = signal.SIGUSR1
_TOUCH_EVERY_S = 1.0


def progress_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"{PROGRESS_PREFIX}{rank}"


def enable_stack_dumps() -> None:
    """Dump every thread's Python stack to stderr (the rank's log) on ``SIGUSR1``."""
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


class RankControl:
    """One rank's side: progress marks and the preemption flag."""

    def __init__(self, run_dir: Path, rank: int, device: torch.device) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.request = self.run_dir / PREEMPT_REQUEST_FILE
        self.progress_path = progress_file(self.run_dir, rank)
        self._last_touch = 0.0
        # A CPU group for the per-step flag: on NCCL reading a device result would stall the GPU queue.
        self.group: dist.ProcessGroup | None = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
            self.group = group if isinstance(group, dist.ProcessGroup) else None
        self.progress_path.write_text(str(os.getpid()), encoding="utf-8")

    def mark_progress(self) -> None:
        """A step or batch finished (cheap: one ``utime`` at most once a second)."""
        now = time.monotonic()
        if now - self._last_touch >= _TOUCH_EVERY_S:
            self._last_touch = now
            # The agent may have cleaned the run directory up: nothing to tell then.
            with contextlib.suppress(OSError):
                os.utime(self.progress_path)

    def start_stop_check(self) -> StopCheck:
        """Look for a preemption request now and start sharing the answer with the other
        ranks (one tiny all-reduce, not waited for here): :meth:`StopCheck.agreed` says,
        on every rank, whether any rank saw one. Every rank starts one at the same step."""
        flag = torch.tensor([1 if self.request.exists() else 0], dtype=torch.int32)
        work = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return StopCheck(flag, work)

    def stop_agreed(self) -> bool:
        """True on every rank when any rank saw a preemption request (one tiny all-reduce)."""
        return self.start_stop_check().agreed()

    def epoch_end_agreed(self, *, checkpoint_due: bool) -> tuple[bool, bool]:
        """At an epoch end, on every rank: whether any rank saw a preemption request and
        whether any rank (rank 0, whose schedule decides) wants a checkpoint. One all-reduce."""
        flags = torch.tensor([int(self.request.exists()), int(checkpoint_due)], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        stop, due = (bool(v) for v in flags.tolist())
        return stop, due

    def write_preempted(self, epoch: int, step_in_epoch: int, step: int) -> None:
        target = self.run_dir / PREEMPTED_FILE
        tmp = target.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"epoch": epoch, "step_in_epoch": step_in_epoch, "step": step}), encoding="utf-8"
        )
        os.replace(tmp, target)


class StopCheck:
    """A preemption check on its way between the ranks (see :meth:`RankControl.start_stop_check`)."""

    def __init__(self, flag: torch.Tensor, work: Any) -> None:
        self.flag = flag
        self.work = work

    def agreed(self) -> bool:
        """Wait for the other ranks' answers: True when any rank saw a preemption request."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return bool(self.flag.item())
