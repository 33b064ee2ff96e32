"""The learning rate a training job runs at, in one place: the trainer sets its optimizer
from :func:`effective_learning_rate`, ``torchyard show`` prints :func:`describe_schedule`
(and the web UI's job form says the same in ``dom.js``'s ``effectiveLrText``).

The built-in trainer scales ``learning_rate`` linearly by the number of training
processes (the world size: nodes × processes per node; each process trains on
``batch_size`` images, so the global batch grows with it). The rate then follows the
schedule of ``worker/trainer/schedule.py``: a linear warm-up over the first
``warmup_epochs`` epochs (the last warm-up step runs at the effective rate), then a
linear decay to 0 at the end of the last epoch (docs/cluster.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchyard.contract.jobspec import JobParameters


def effective_learning_rate(learning_rate: float, world_size: int) -> float:
    """The peak rate the trainer's optimizer runs at: ``learning_rate × world_size``."""
    return learning_rate * max(1, int(world_size))


def world_size_of(resources: Mapping[str, Any] | None) -> int:
    """The training processes of a job's resources: nodes × processes per node."""
    r = resources or {}
    return max(1, int(r.get("node_count") or 1)) * max(1, int(r.get("process_count_per_node") or 1))


def _number(value: float) -> str:
    """A rate as the web UI writes it (6 significant digits, no trailing zeros)."""
    return repr(float(f"{value:.6g}"))


@dataclass(frozen=True)
class LearningRateSchedule:
    """A training job's learning-rate settings and the rate the trainer derives from them."""

    learning_rate: float
    world_size: int
    warmup_epochs: int
    epochs: int

    @property
    def effective(self) -> float:
        return effective_learning_rate(self.learning_rate, self.world_size)

    def effective_text(self) -> str:
        """``0.05 × 2 processes = 0.1 effective`` or ``0.05 (1 process: effective 0.05)``."""
        lr, eff = _number(self.learning_rate), _number(self.effective)
        if self.world_size > 1:
            return f"{lr} × {self.world_size} processes = {eff} effective"
        return f"{lr} (1 process: effective {eff})"

    def schedule_text(self) -> str:
        """How the rate moves over the epochs."""
        if self.warmup_epochs <= 0:
            start = "from the first step"
        else:
            epochs = "epoch" if self.warmup_epochs == 1 else f"{self.warmup_epochs} epochs"
            start = f"reached after a linear warm-up over the first {epochs}"
        return f"{start}, then a linear decay to 0 at the end of epoch {self.epochs}"

    def describe(self) -> str:
        return f"{self.effective_text()}; {self.schedule_text()}"


def schedule_of(
    parameters: Mapping[str, Any] | None, resources: Mapping[str, Any] | None
) -> LearningRateSchedule:
    """The schedule of a training job's ``parameters`` and ``resources`` (the service's
    defaults for what they leave out)."""
    p = parameters or {}
    defaults = JobParameters.model_fields

    def get(name: str) -> Any:
        value = p.get(name)
        return defaults[name].default if value is None else value

    return LearningRateSchedule(
        learning_rate=float(get("learning_rate")),
        world_size=world_size_of(resources),
        warmup_epochs=int(get("warmup_epochs")),
        epochs=int(get("epochs")),
    )


def describe_schedule(parameters: Mapping[str, Any] | None, resources: Mapping[str, Any] | None) -> str:
    """One line for people: the effective rate and its warm-up and decay."""
    return schedule_of(parameters, resources).describe()
