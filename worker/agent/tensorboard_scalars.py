"""TensorBoard scalars of a script job's processes become its metrics (SPEC §14).

A :class:`ScalarTailer` looks, about every second, for TensorBoard event files
(``*tfevents*``) under a placement's working copies and its ``outputs``/``logs`` folders,
reads what was appended to each with TensorBoard's own event-file loader, and appends the
scalars as JSON lines to ``metrics/tensorboard.jsonl``: from there the reporter ships them
like every other metric line (exactly once, keyed by name, rank and step). The tag is the
metric's name (spaces become ``_``; a tag that still is not a metric name is skipped, said
once in the job's log), the event's step its step. A file under a process's own working
copy carries that process's rank; one under the shared folders (or a ``per_node``
command's copy) the node's first rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchyard.contract.metrics import is_metric_name

log = logging.getLogger(__name__)

METRICS_FILE_NAME = "tensorboard.jsonl"
POLL_S = 1.0
MAX_EVENT_FILES = 200
_SPACES = re.compile(r"\s")


def _loader(path: Path) -> Any:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return EventFileLoader(str(path))


def _scalar(value: Any) -> float | None:
    """The number of one summary value: a ``simple_value`` or a scalar tensor of the scalars plugin."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
        from tensorboard.util import tensor_util

        array = tensor_util.make_ndarray(value.tensor)
        if array.size == 1:
            return float(array.reshape(()))
    return None


class ScalarTailer:
    """Reads the event files of one placement as they grow."""

    def __init__(
        self, roots: list[tuple[Path, int, bool]], metrics_dir: Path, job_log: logging.Logger
    ) -> None:
        # (folder, rank of what is found there, whether the folder is shared by the node)
        self.roots = roots
        self.out = metrics_dir / METRICS_FILE_NAME
        self.job_log = job_log
        self.loaders: dict[Path, tuple[Any, int]] = {}
        self._skipped_tags: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.available = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tensorboard-scalars", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and read what the files hold now (every process has ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def _event_files(self) -> Iterator[tuple[Path, int]]:
        for root, rank, _ in self.roots:
            if not root.is_dir():
                continue
            for folder, dirs, names in os.walk(root, followlinks=False):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                for name in sorted(names):
                    if "tfevents" in name:
                        yield Path(folder) / name, rank

    def poll(self) -> int:
        """Append the scalars written since the last look; how many."""
        if not self.available:
            return 0
        with self._lock:
            try:
                for path, rank in self._event_files():
                    if path not in self.loaders and len(self.loaders) < MAX_EVENT_FILES:
                        self.loaders[path] = (_loader(path), rank)
                lines = [
                    line for loader, rank in list(self.loaders.values()) for line in self._read(loader, rank)
                ]
            except ImportError:
                self.available = False
                self.job_log.warning(
                    "TensorBoard event files are not read: this worker lacks the tensorboard package"
                )
                return 0
            except Exception:  # a reading bug must not stop the job
                log.exception("reading TensorBoard event files failed")
                return 0
            if lines:
                with open(self.out, "a", encoding="utf-8") as fh:
                    fh.write("".join(lines))
            return len(lines)

    def _read(self, loader: Any, rank: int) -> Iterator[str]:
        for event in loader.Load():
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                number = _scalar(value)
                if number is None or not math.isfinite(number):
                    continue  # the metrics API holds finite numbers
                name = _SPACES.sub("_", value.tag)
                if not is_metric_name(name):
                    if value.tag not in self._skipped_tags:
                        self._skipped_tags.add(value.tag)
                        self.job_log.warning(
                            "TensorBoard scalar %r is not kept: a metric name is letters, digits and "
                            "_ . : / - (at most 64)",
                            value.tag,
                        )
                    continue
                point = {
                    "name": name,
                    "value": number,
                    "step": max(0, int(event.step)),
                    "rank": rank,
                    "time": float(event.wall_time),
                }
                yield json.dumps(point, separators=(",", ":")) + "\n"
