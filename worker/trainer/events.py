"""``events.jsonl``: the metric, progress and result stream the worker agent tails.

One JSON object per line (a model of :mod:`torchyard.contract.run_events`), flushed as
soon as it is written. Only global rank 0 writes (:class:`NullEventWriter` elsewhere).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, TextIO

from torchyard.contract.jobfile import EVENTS_FILE
from torchyard.contract.metrics import METRIC_NAMES
from torchyard.contract.run_events import MetricEvent, ProgressEvent, ResultEvent

__all__ = ["EVENTS_FILE", "EventWriter", "NullEventWriter"]


class EventWriter:
    """Appends events to ``<output_dir>/events.jsonl`` (appending keeps a resumed attempt's history)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: TextIO | None = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def emit(self, event: MetricEvent | ProgressEvent | ResultEvent) -> None:
        if self._fh is None:
            raise RuntimeError("event writer is closed")
        self._fh.write(event.model_dump_json(exclude_none=True) + "\n")
        self._fh.flush()

    def metric(self, name: str, value: float, *, epoch: int, step: int) -> None:
        """One point of a trainer metric; ``ValueError`` for an unknown name or a value that is not finite."""
        if name not in METRIC_NAMES:
            raise ValueError(f"unknown metric {name!r}")
        event = MetricEvent.model_validate(
            {"name": name, "value": float(value), "epoch": epoch, "step": step, "time": time.time()}
        )
        self.emit(event)

    def progress(self, *, epoch: int, epochs: int, step: int, total_steps: int) -> None:
        self.emit(
            ProgressEvent(epoch=epoch, epochs=epochs, step=step, total_steps=total_steps, time=time.time())
        )

    def result(
        self,
        *,
        best_epoch: int,
        best: dict[str, Any],
        final: dict[str, Any] | None,
        stopped_early: bool,
        epochs_run: int,
        evaluation: dict[str, Any] | None = None,
    ) -> None:
        """The run's summary (an evaluation's: its figures in ``evaluation``)."""
        self.emit(
            ResultEvent.model_validate(
                {
                    "best_epoch": best_epoch,
                    "best": best,
                    "final": final,
                    "stopped_early": stopped_early,
                    "epochs_run": epochs_run,
                    "evaluation": evaluation,
                    "time": time.time(),
                }
            )
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

    def emit(self, event: MetricEvent | ProgressEvent | ResultEvent) -> None:
        return None
