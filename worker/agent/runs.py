"""Pruning of finished run directories, so a long-lived node's disk does not fill up.

Each placement trains in ``<work dir>/runs/<job>-a<attempt>-<node>``: the job file,
the ranks' logs, per-epoch checkpoints and the model directory. Everything a user
needs from there has been shipped to the API by the time the placement ends (logs,
metrics, the model), so once the API has recorded the placement's end the agent removes
the bulky part of its run directory (:func:`shed_results`: checkpoints, the model
directory, a script's outputs, code and inputs), keeps the small rest (job file, logs)
of the most recent finished runs for an operator's post-mortem, and removes older ones.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_KEEP_RUNS = 10


def prune_runs(
    runs_dir: Path, keep: int, active: Iterable[Path], companions: Path | None = None
) -> list[Path]:
    """Remove finished run directories beyond the ``keep`` most recently modified.

    Directories in ``active`` (placements still running) are never touched, nor
    counted. A removed run's folder of the same name under ``companions`` (the agent's own
    files of the placement) goes with it, and so does one whose run is gone. Returns what
    was removed.
    """
    try:
        return _prune(runs_dir, keep, active)
    finally:
        if companions is not None:
            _prune_companions(runs_dir, companions)


def _prune_companions(runs_dir: Path, companions: Path) -> None:
    try:
        entries = [p for p in companions.iterdir() if p.is_dir() and not p.is_symlink()]
    except FileNotFoundError:
        return
    for path in entries:
        if not (runs_dir / path.name).exists():
            shutil.rmtree(path, ignore_errors=True)


def _prune(runs_dir: Path, keep: int, active: Iterable[Path]) -> list[Path]:
    if keep < 0:
        raise ValueError("keep must be 0 or more")
    live = {p.resolve() for p in active}
    try:
        entries = [p for p in runs_dir.iterdir() if p.is_dir() and not p.is_symlink()]
    except FileNotFoundError:
        return []
    finished = [p for p in entries if p.resolve() not in live]
    finished.sort(key=_modified, reverse=True)
    removed = []
    for path in finished[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
        else:
            log.warning("could not remove the old run directory %s", path)
    if removed:
        log.info(
            "removed %d old run director%s from %s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            runs_dir,
        )
    return removed


# What a finished run directory no longer needs once the API recorded its end: the model
# directory and checkpoints (stored by the API), a script's outputs (uploaded), its copy of
# the code and its inputs (links or copies of the node's cached datasets).
SHED_DIRS = ("model", "outputs", "work", "inputs")
SHED_SUFFIXES = (".pt", ".tar.gz", ".safetensors", ".onnx")


def shed_results(run_dir: Path) -> int:
    """Remove the bulky results of a finished run whose end the API has recorded; the bytes
    freed. Logs, the job file and small state files stay for a post-mortem."""
    freed = 0
    try:
        entries = list(run_dir.iterdir())
    except FileNotFoundError:
        return 0
    for path in entries:
        if path.is_symlink():
            continue
        if path.is_dir() and path.name in SHED_DIRS:
            freed += _size(path)
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file() and path.name.endswith(SHED_SUFFIXES):
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
    if freed:
        log.info("removed %d bytes of stored results from %s", freed, run_dir)
    return freed


def _size(folder: Path) -> int:
    total = 0
    for child in folder.rglob("*"):
        try:
            if child.is_file() and not child.is_symlink():
                total += child.stat().st_size
        except OSError:
            pass
    return total


def _modified(path: Path) -> float:
    """When the run last changed: its directory or its newest top-level file."""
    try:
        times = [path.stat().st_mtime] + [child.stat().st_mtime for child in path.iterdir()]
    except OSError:
        return 0.0
    return max(times)
