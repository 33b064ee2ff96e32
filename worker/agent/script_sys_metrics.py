"""A script job's system metrics (docs/operations.md, "System metrics of each rank"): the
agent samples each process it started every ``TORCHYARD_SYS_METRICS_INTERVAL_S`` seconds
(its own setting; default 5, 0 turns it off), from outside, as the built-in trainer's ranks
sample themselves:

* ``sys.cpu_percent``: CPU time of the process and its live descendants over the window's
  wall time, in percent of one core;
* ``sys.rss_bytes``: the largest resident memory among the process and its descendants (the
  script's own process, under the agent's small wrappers; its workers share most of theirs);
* ``sys.gpu_util`` and ``sys.gpu_memory_bytes``: NVML's view of the process's GPU (the one at
  its local rank among the placement's, or the placement's only one for a per-node command);
  absent without a GPU or NVML.

``sys.input_wait_fraction`` needs the training loop's own clock: a script's is not known.

The points go to ``sys-rank-<rank>.jsonl`` in the agent's own metrics folder of the
placement, which the reporter ships with the script's other metrics. Their step is the
latest step the script logged for that rank, else the seconds since the processes started;
a second sample at the same step is its next ``occurrence``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from torchyard.contract.metrics import sys_metrics_file
from worker.system_probe import GpuProbe, process_rss_bytes, process_tree, process_tree_cpu_seconds

log = logging.getLogger(__name__)


def tree_rss_bytes(pid: int) -> int | None:
    """The largest resident memory among ``pid`` and its descendants; None when it is gone
    (or ending: a process that exited and was not waited for yet has none)."""
    sizes = [rss for p in process_tree(pid) if (rss := process_rss_bytes(p))]
    return max(sizes) if sizes else None


@dataclass
class SampledProcess:
    """One process of a script job as the sampler sees it."""

    rank: int
    pid: Callable[[], int | None]  # None until started, or once it has ended
    gpu: GpuProbe | None = None
    cpu_seconds: float | None = None  # at the window's start
    started: float = 0.0  # the window's start (the sampler's clock)
    last_step: int | None = None
    occurrence: int = 0
    fh: TextIO | None = None


class ScriptSystemSampler:
    """Samples a placement's script processes from a background thread every ``interval`` s.

    ``latest_step(rank)`` is the latest step the script logged for a rank (None: none yet);
    ``clock`` is monotonic, ``wall`` stamps the points."""

    def __init__(
        self,
        processes: list[SampledProcess],
        folder: Path,
        interval: float,
        *,
        latest_step: Callable[[int], int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.processes = processes
        self.folder = Path(folder)
        self.interval = interval
        self.latest_step = latest_step or (lambda rank: None)
        self.clock = clock
        self.wall = wall
        self.began = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        now = self.clock()
        for proc in self.processes:
            pid = proc.pid()
            proc.cpu_seconds = process_tree_cpu_seconds(pid) if pid is not None else None
            proc.started = now
        self._thread = threading.Thread(target=self._run, name="script-sys-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # a reading gone wrong never ends the run
                log.exception("sampling the script's processes failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        for proc in self.processes:
            if proc.fh is not None:
                proc.fh.close()
                proc.fh = None

    def sample(self) -> None:
        """One point of each metric for every live process; the next window starts now."""
        now = self.clock()
        for proc in self.processes:
            pid = proc.pid()
            if pid is None:
                continue
            rss = tree_rss_bytes(pid)
            if rss is None:
                continue  # ended: its last window is not a whole one
            values = {"sys.rss_bytes": float(rss)}
            cpu = process_tree_cpu_seconds(pid)
            elapsed = now - proc.started
            if cpu is not None and proc.cpu_seconds is not None and elapsed > 0:
                values["sys.cpu_percent"] = max(0.0, (cpu - proc.cpu_seconds) / elapsed * 100.0)
            if proc.gpu is not None:
                values.update(proc.gpu.sample())
            proc.cpu_seconds, proc.started = cpu, now
            self._write(proc, values, now)

    def _write(self, proc: SampledProcess, values: dict[str, float], now: float) -> None:
        if not values:
            return
        step = self.latest_step(proc.rank)
        if step is None:
            step = int(now - self.began)
        if step == proc.last_step:
            proc.occurrence += 1
        else:
            proc.last_step, proc.occurrence = step, 0
        if proc.fh is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            proc.fh = open(self.folder / sys_metrics_file(proc.rank), "a", encoding="utf-8")  # noqa: SIM115
        stamp = self.wall()
        base = {"step": step, "rank": proc.rank, "time": stamp}
        if proc.occurrence:
            base["occurrence"] = proc.occurrence
        proc.fh.write(
            "".join(
                json.dumps({"name": name, "value": value, **base}) + "\n"
                for name, value in values.items()
                if math.isfinite(value)
            )
        )
        proc.fh.flush()
