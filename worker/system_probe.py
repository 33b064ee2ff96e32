"""What a process uses, read from ``/proc`` and NVML: the readings behind each rank's system
metrics (docs/operations.md, "System metrics of each rank").

The built-in trainer's ranks read themselves (:mod:`worker.trainer.system_metrics`); the agent
reads a script job's processes from outside (:mod:`worker.agent.script_sys_metrics`). Both
take the interval from ``TORCHYARD_SYS_METRICS_INTERVAL_S`` (:func:`sampling_interval`).
Plain Python, no torch: the agent imports it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

INTERVAL_VARIABLE = "TORCHYARD_SYS_METRICS_INTERVAL_S"
DEFAULT_INTERVAL_S = 5.0


def sampling_interval(env: Mapping[str, str] | None = None) -> float:
    """``TORCHYARD_SYS_METRICS_INTERVAL_S`` in seconds (0: no sampling); ``ValueError`` when it
    is not a number >= 0."""
    raw = (os.environ if env is None else env).get(INTERVAL_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{INTERVAL_VARIABLE} must be a number of seconds, not {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{INTERVAL_VARIABLE} must be 0 (off) or a positive number of seconds, not {raw!r}")
    return value


# --- /proc --------------------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 onwards); None when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces or parentheses itself.
    return raw[raw.rfind(b")") + 2 :].decode("ascii", "replace").split()


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as fh:
                found.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError):
            continue
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, ``pid`` first; empty when ``pid`` is gone."""
    if _stat_fields(pid) is None:
        return []
    found: list[int] = []
    pending = [pid]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        found.append(current)
        pending.extend(_children(current))
    return found


def process_tree_cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of ``pid`` and its live descendants (their finished,
    waited-for children included); None when ``pid`` is gone."""
    total = 0.0
    pending = [pid]
    seen: set[int] = set()
    first = True
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        fields = _stat_fields(current)
        if fields is None:
            if first:
                return None
            continue
        first = False
        # utime, stime, cutime, cstime: fields 14-17, at 11-14 once the pid and name are cut.
        total += sum(int(v) for v in fields[11:15]) / _TICKS
        pending.extend(_children(current))
    return total


def process_rss_bytes(pid: int) -> int | None:
    """The resident memory of ``pid`` (``/proc/<pid>/statm``); None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


# --- NVML ---------------------------------------------------------------------------------------


class GpuProbe:
    """NVML's view of one GPU: utilization and memory in use. ``open`` answers None where there
    is no NVML (no driver, no ``nvidia-ml-py``) or no such GPU: the GPU metrics are then absent."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle

    @classmethod
    def open(cls, *, uuid: str | None = None, index: int | None = None) -> GpuProbe | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            if uuid:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            elif index is not None:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            else:
                return None
            pynvml.nvmlDeviceGetUtilizationRates(handle)
        except Exception as exc:  # no library, no driver, no device: no GPU metrics
            log.debug("no GPU metrics: %s", exc)
            return None
        return cls(pynvml, handle)

    @classmethod
    def named(cls, device: str) -> GpuProbe | None:
        """The probe of a ``CUDA_VISIBLE_DEVICES`` entry: an index or a ``GPU-``/``MIG-`` UUID."""
        device = device.strip()
        if device.isdigit():
            return cls.open(index=int(device))
        return cls.open(uuid=device) if device.startswith(("GPU-", "MIG-")) else None

    def sample(self) -> dict[str, float]:
        try:
            util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        except Exception as exc:  # a GPU metric that cannot be read is left out, never an error
            log.debug("GPU metrics unreadable: %s", exc)
            return {}
        return {"sys.gpu_util": float(util.gpu), "sys.gpu_memory_bytes": float(memory.used)}
