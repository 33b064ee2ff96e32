"""Evaluations on the agent: the trainer in evaluation mode on the registered model's
directory; its outcome is its result (reported by rank 0), it keeps no model of its own."""

from __future__ import annotations

from typing import ClassVar

from torchyard.contract.jobfile import TrainerTask
from torchyard.contract.jobspec import JobKind
from worker.agent.kinds.trainer import TrainerRun


class EvaluateRun(TrainerRun):
    kind: ClassVar[JobKind] = JobKind.EVALUATE
    task = TrainerTask.EVALUATE
