"""``checkpoint.pt``: the full resumable state, written atomically after every epoch.

Contents (plain tensors and Python scalars, so ``torch.load(weights_only=True)`` reads it):
``format_version``, ``job_id``, ``architecture``, ``classes``, ``world_size``,
``epoch`` (epochs completed), ``step`` (optimizer steps taken), ``model`` (state dict,
no ``module.`` prefix), ``optimizer``, ``scheduler``, ``early_stopping`` (best val
loss, best epoch, epochs without improvement), ``best_metric`` (lowest val loss),
``best_epoch``, ``best_model`` (weights of the best epoch, or None when that is
``model``), ``history`` (per-epoch metrics) and ``stopped`` (early stop reached).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT_VERSION = 1


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` through a temporary file and ``os.replace``."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"format_version": FORMAT_VERSION, **state}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def load_checkpoint(
    path: str | Path, *, job_id: str, architecture: str, classes: list[str]
) -> dict[str, Any] | None:
    """The checkpoint at ``path`` if it exists and belongs to this job, else None.

    Loaded with ``weights_only=True``: nothing beyond tensors and plain containers is
    unpickled. A checkpoint of another job or model is ignored with a warning.
    """
    file = Path(path)
    if not file.is_file():
        return None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # an unreadable checkpoint must not block the job
        log.warning("ignoring %s: cannot read it (%s); starting from scratch", file.name, exc)
        return None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        log.warning("ignoring %s: unknown checkpoint format", file.name)
        return None
    mismatches = [
        key
        for key, expected in (("job_id", job_id), ("architecture", architecture), ("classes", classes))
        if state.get(key) != expected
    ]
    if mismatches:
        log.warning("ignoring %s: it belongs to another job (%s differ)", file.name, ", ".join(mismatches))
        return None
    return state
