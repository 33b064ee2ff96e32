"""Each rank's system metrics: its CPU use, memory, GPU use and how long it waited on its input.

Every rank (not only rank 0) samples itself every ``TORCHYARD_SYS_METRICS_INTERVAL_S``
seconds (a node setting the agent passes on to the ranks; default 5, 0 turns it off) and
appends the points to ``sys-rank-<RANK>.jsonl`` in the run folder, one JSON object a line,
``{"name", "value", "epoch", "step", "rank", "time"}``; the agent ships them with the job's
other metrics (docs/operations.md, "System metrics"):

* ``sys.cpu_percent``: CPU time of the rank and its live descendants (the DataLoader's
  workers) over the window's wall time, in percent of one core (400: four cores busy);
* ``sys.rss_bytes``: the rank process's resident memory (its workers share most of it);
* ``sys.gpu_util`` and ``sys.gpu_memory_bytes``: NVML's utilization of the rank's GPU (percent
  of the time a kernel ran) and the memory in use on it; absent without a GPU or without NVML;
* ``sys.input_wait_fraction``: the part of the window's training steps' wall time the rank
  spent waiting for its next batch (the DataLoader's ``next()``); near 1, the input pipeline
  is the bottleneck.

The training loop's cost is a clock comparison per step (:meth:`SystemSampler.step_done`
is given the time the loop read anyway); reading ``/proc`` and NVML happens once per
interval (bench/bench_system_metrics.py measures both). The readings themselves are
:mod:`worker.system_probe`'s, which the agent uses for script jobs' processes too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from torchyard.contract.metrics import sys_metrics_file
from worker.system_probe import GpuProbe, process_rss_bytes, process_tree_cpu_seconds

log = logging.getLogger(__name__)


def cuda_probe(device: Any) -> GpuProbe | None:
    """The probe of a rank's CUDA device (a ``torch.device``); None on the CPU."""
    if getattr(device, "type", None) != "cuda":
        return None
    uuid = None
    try:
        import torch

        props = torch.cuda.get_device_properties(device)
        raw = getattr(props, "uuid", None)
        if raw is not None:
            text = str(raw)
            uuid = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    except Exception as exc:
        log.debug("no CUDA device properties: %s", exc)
    return GpuProbe.open(uuid=uuid, index=getattr(device, "index", None) if uuid is None else None)


# --- the sampler --------------------------------------------------------------------------------


@dataclass
class _Window:
    started: float  # the clock at the window's start
    cpu_seconds: float | None
    waited: float = 0.0
    stepping: float = 0.0
    steps: int = 0


class SystemSampler:
    """One rank's sampler, driven by the training loop.

    The loop calls :meth:`step_done` after each step with the time it read and how long the
    step waited for its batch; every ``interval`` seconds of that clock the sampler reads
    ``/proc`` (and NVML) and writes one point of each metric. ``clock`` (the loop's
    ``time.perf_counter`` by default) and ``read`` (the process readings) are there for tests.
    """

    def __init__(
        self,
        path: Path,
        rank: int,
        interval: float,
        *,
        pid: int | None = None,
        gpu: GpuProbe | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
        cpu_seconds: Callable[[int], float | None] = process_tree_cpu_seconds,
        rss_bytes: Callable[[int], int | None] = process_rss_bytes,
    ) -> None:
        self.path = Path(path)
        self.rank = rank
        self.interval = interval
        self.pid = os.getpid() if pid is None else pid
        self.gpu = gpu
        self.clock = clock
        self.wall = wall
        self.cpu_seconds = cpu_seconds
        self.rss_bytes = rss_bytes
        self._fh: TextIO | None = None
        now = clock()
        self.window = _Window(now, cpu_seconds(self.pid))
        self.due = now + interval

    def step_done(self, epoch: int, step: int, *, started: float, fetched: float, now: float) -> None:
        """A training step ended at ``now``: it asked for its batch at ``started`` and had it at
        ``fetched`` (all three read from ``clock``). Samples when the interval is up."""
        window = self.window
        window.waited += fetched - started
        window.stepping += now - started
        window.steps += 1
        if now >= self.due:
            self.sample(epoch, step, now)

    def flush(self, epoch: int, step: int) -> None:
        """Sample now if the window holds a step (an epoch's end: a short job gets its points)."""
        if self.window.steps:
            self.sample(epoch, step, self.clock())

    def sample(self, epoch: int, step: int, now: float) -> None:
        """Write the window's points and start the next window at ``now``."""
        window = self.window
        values: dict[str, float] = {}
        cpu = self.cpu_seconds(self.pid)
        elapsed = now - window.started
        if cpu is not None and window.cpu_seconds is not None and elapsed > 0:
            values["sys.cpu_percent"] = max(0.0, (cpu - window.cpu_seconds) / elapsed * 100.0)
        rss = self.rss_bytes(self.pid)
        if rss is not None:
            values["sys.rss_bytes"] = float(rss)
        if self.gpu is not None:
            values.update(self.gpu.sample())
        if window.stepping > 0:
            values["sys.input_wait_fraction"] = min(1.0, max(0.0, window.waited / window.stepping))
        self._write(values, epoch, step)
        self.window = _Window(now, cpu)
        self.due = now + self.interval

    def _write(self, values: dict[str, float], epoch: int, step: int) -> None:
        if not values:
            return
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        stamp = self.wall()
        lines = "".join(
            json.dumps(
                {"name": name, "value": value, "epoch": epoch, "step": step, "rank": self.rank, "time": stamp}
            )
            + "\n"
            for name, value in values.items()
            if math.isfinite(value)
        )
        self._fh.write(lines)
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class _NoSampler:
    """What the loop calls when the metrics are off: nothing happens."""

    def step_done(self, epoch: int, step: int, *, started: float, fetched: float, now: float) -> None:
        return None

    def flush(self, epoch: int, step: int) -> None:
        return None


NO_SAMPLER = _NoSampler()


def rank_sampler(output_dir: Path, rank: int, device: Any, interval: float) -> SystemSampler | None:
    """This rank's sampler every ``interval`` seconds (:func:`sampling_interval`; None when 0)."""
    if interval <= 0:
        return None
    return SystemSampler(Path(output_dir) / sys_metrics_file(rank), rank, interval, gpu=cuda_probe(device))
