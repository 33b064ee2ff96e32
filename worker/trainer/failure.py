"""``failure-rank-<RANK>.json``: why a rank failed, for the worker agent to report
(:class:`torchyard.contract.failures.RankFailure`).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from torchyard.contract.errors import RankFailedError, TorchyardError
from torchyard.contract.failures import RankFailure

TRACEBACK_LINES = 40
MAX_MESSAGE_CHARS = 4000
_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe")


def failure_file(output_dir: str | Path, rank: int) -> Path:
    return Path(output_dir) / f"failure-rank-{rank}.json"


def _unwrap_loader_message(message: str) -> str:
    """DataLoader workers re-raise as ``Caught X in DataLoader worker...`` plus a
    traceback; the last line carries the original message."""
    if "Original Traceback" not in message:
        return message
    last = [line for line in message.strip().splitlines() if line.strip()][-1]
    _, sep, rest = last.partition(": ")
    return rest if sep else last


def is_secondary(exc: BaseException) -> bool:
    if isinstance(exc, TorchyardError):
        return False
    dist_errors: tuple[type[BaseException], ...] = ()
    if hasattr(torch.distributed, "DistError"):
        dist_errors = (torch.distributed.DistError,)
    if dist_errors and isinstance(exc, dist_errors):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _COLLECTIVE_MARKERS)


def classify(exc: BaseException) -> tuple[str, str]:
    """``(code, message)`` for an exception raised in a rank."""
    if isinstance(exc, TorchyardError):
        return exc.code, _unwrap_loader_message(exc.message)
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, torch.OutOfMemoryError):
        message += " (try a smaller batch_size or image_size)"
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return RankFailedError.code, message


def failure_record(exc: BaseException, *, rank: int, local_rank: int, node: str) -> RankFailure:
    code, message = classify(exc)
    lines = "".join(traceback.format_exception(exc)).splitlines()
    return RankFailure(
        code=code,
        message=message,
        rank=rank,
        local_rank=local_rank,
        node=node,
        traceback="\n".join(lines[-TRACEBACK_LINES:]),
        time=time.time(),
        secondary=is_secondary(exc),
    )


def write_failure(output_dir: str | Path, record: RankFailure) -> Path:
    """Write the record atomically (temporary file, then ``os.replace``)."""
    target = failure_file(output_dir, record.rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(record.model_dump_json(indent=2) + "\n")
    os.replace(tmp, target)
    return target
