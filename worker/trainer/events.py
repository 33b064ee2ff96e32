"""``events.jsonl``: the metric, progress and result stream the worker agent tails.

One JSON object per line, flushed as soon as it is written. Only global rank 0 writes
(:class:`NullEventWriter` elsewhere). Metric names and shapes are part of the agent
contract; see the package docs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

from torchyard.contract.jobfile import EVENTS_FILE
from torchyard.contract.metrics import METRIC_NAMES

__all__ = ["EVENTS_FILE", "EventWriter", "NullEventWriter"]


class EventWriter:
    """Appends events to ``<output_dir>/events.jsonl`` (appending keeps a resumed attempt's history)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: TextIO | None = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def emit(self, event: dict[str, Any]) -> None:
        if self._fh is None:
            raise RuntimeError("event writer is closed")
        self._fh.write(json.dumps(event, allow_nan=False, separators=(",", ":")) + "\n")
        self._fh.flush()

    def metric(self, name: str, value: float, *, epoch: int, step: int) -> None:
        if name not in METRIC_NAMES:
            raise ValueError(f"unknown metric {name!r}")
        if not math.isfinite(value):
            raise ValueError(f"metric {name} is not finite: {value}")
        self.emit(
            {
                "type": "metric",
                "name": name,
                "value": float(value),
                "epoch": epoch,
                "step": step,
                "rank": 0,
                "time": time.time(),
            }
        )

    def progress(self, *, epoch: int, epochs: int, step: int, total_steps: int) -> None:
        self.emit(
            {
                "type": "progress",
                "epoch": epoch,
                "epochs": epochs,
                "step": step,
                "total_steps": total_steps,
                "time": time.time(),
            }
        )

    def result(
        self,
        *,
        best_epoch: int,
        best: dict[str, float],
        final: dict[str, float],
        stopped_early: bool,
        epochs_run: int,
    ) -> None:
        self.emit(
            {
                "type": "result",
                "best_epoch": best_epoch,
                "best": best,
                "final": final,
                "stopped_early": stopped_early,
                "epochs_run": epochs_run,
                "time": time.time(),
            }
        )

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class NullEventWriter(EventWriter):
    """What ranks other than 0 get: accepts every event, writes nothing."""

    def __init__(self) -> None:
        self.path = Path(EVENTS_FILE)
        self._fh = None

    def emit(self, event: dict[str, Any]) -> None:
        return None
