"""Helpers for a script job's own code (docs/script-jobs.md). Standard library only: a script may
import it from an installed torchyard or copy this file next to itself.

    from torchyard import run

    run.log_metric("train.loss", loss, step=step, epoch=epoch)
    torch.save(model.state_dict(), run.output_dir() / "model.pt")

``log_metric`` appends one JSON line to the file named by ``TORCHYARD_METRICS_FILE``;
the worker agent ships those lines into the job's metrics (``GET /v1/jobs/{id}/metrics``,
the events stream and the CLI). Outside a job (the variable unset) it does nothing, so a
script runs unchanged on a laptop. Names: letters, digits and ``_ . : / -``, at most 64.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from pathlib import Path

__all__ = ["log_dir", "log_metric", "output_dir"]

METRICS_FILE_VAR = "TORCHYARD_METRICS_FILE"
OUTPUT_DIR_VAR = "TORCHYARD_OUTPUT_DIR"
LOG_DIR_VAR = "TORCHYARD_LOG_DIR"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,63}$")
_lock = threading.Lock()
_steps: dict[str, int] = {}


def _rank() -> int:
    try:
        return max(0, int(os.environ.get("RANK", "0")))
    except ValueError:
        return 0


def log_metric(name: str, value: float, step: int | None = None, epoch: int | None = None) -> None:
    """Record one value of metric ``name``. Without ``step``, each call of the same name in
    this process takes the next step (0, 1, 2...). Refuses bad names and non-finite values
    with ValueError, so a mistake shows at once rather than as a missing chart."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"metric name {name!r}: use letters, digits and _ . : / - (at most 64)")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"metric {name}: {value!r} is not a finite number")
    for label, given in (("step", step), ("epoch", epoch)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 0):
            raise ValueError(f"metric {name}: {label} must be an integer >= 0, not {given!r}")
    path = os.environ.get(METRICS_FILE_VAR)
    with _lock:
        if step is None:
            step = _steps.get(name, -1) + 1
        _steps[name] = max(step, _steps.get(name, -1))
        if not path:
            return
        record = {
            "name": name,
            "value": number,
            "step": step,
            "epoch": 0 if epoch is None else epoch,
            "rank": _rank(),
            "time": time.time(),
        }
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        # One write of a whole line with O_APPEND: processes sharing the file never interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _folder(var: str, default: str) -> Path:
    path = Path(os.environ.get(var) or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def output_dir() -> Path:
    """Where to write what should be kept (``TORCHYARD_OUTPUT_DIR``, else ``./outputs``)."""
    return _folder(OUTPUT_DIR_VAR, "outputs")


def log_dir() -> Path:
    """Where to write extra log files (``TORCHYARD_LOG_DIR``, else ``./logs``)."""
    return _folder(LOG_DIR_VAR, "logs")
