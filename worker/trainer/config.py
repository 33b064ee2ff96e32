"""The job description the agent writes as ``job.json`` (parsed and validated).

The document's model lives in the contract (:mod:`torchyard.contract.jobfile`): the agent
writes it from the same classes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import ValidationError

from torchyard.contract.errors import RankFailedError
from torchyard.contract.jobfile import (
    DatasetRef,
    Datasets,
    JobConfig,
    ModelSpec,
    Parameters,
    TrainerTask,
)

__all__ = ["DatasetRef", "Datasets", "JobConfig", "ModelSpec", "Parameters", "TrainerTask", "load_job"]

log = logging.getLogger(__name__)


def load_job(path: str | Path) -> JobConfig:
    """Read and validate ``job.json``; a malformed file is a ``RankFailedError``."""
    file = Path(path)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        job = JobConfig.model_validate(raw)
    except (OSError, ValueError, ValidationError) as exc:
        raise RankFailedError(f"invalid job configuration {file.name}: {exc}") from exc
    unknown = job.unknown_fields()
    if unknown:
        log.warning("ignoring unknown job.json fields: %s", ", ".join(unknown))
    return job
