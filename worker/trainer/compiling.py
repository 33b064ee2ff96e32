"""``torch.compile`` of the training forward pass (``TORCHYARD_COMPILE``).

Compiling ResNet-50's training step made it 19 % faster on an H100 (bench/RESULTS.md), but
compiling takes about a minute, which a short job never wins back. So by default (``auto``)
a job on CUDA trains its first epoch eagerly, and compiles from the next one on when that
epoch's pace says the rest of the job will take at least ``AUTO_MIN_REMAINING_S``; every
rank takes the same decision. ``on`` compiles from the first step (on any device), ``off``
never.

Only full batches run compiled: a rank's shorter last batch runs eagerly rather than
triggering a second compilation for its shape. Validation always runs the plain model. A
model that fails to compile trains on eagerly, with a warning in the rank's log.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from worker.trainer.distributed import all_reduce_sum

log = logging.getLogger(__name__)

ENV_SWITCH = "TORCHYARD_COMPILE"
SETTINGS = ("auto", "on", "off")
# ``auto`` compiles once the rest of the job is expected to take this long (seconds).
AUTO_MIN_REMAINING_S = 600.0


def compile_setting() -> str:
    raw = os.environ.get(ENV_SWITCH, "auto").strip().lower() or "auto"
    aliases = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}
    value = aliases.get(raw, raw)
    if value not in SETTINGS:
        raise ValueError(f"{ENV_SWITCH} must be auto, on or off, not {raw!r}")
    return value


def worth_compiling(seconds_per_step: float, remaining_steps: int) -> bool:
    """Whether the rest of a job at this pace is long enough to win back a compilation."""
    return seconds_per_step * remaining_steps >= AUTO_MIN_REMAINING_S


class CompiledForward:
    """The training forward pass: ``model`` eagerly, or compiled once :meth:`compile` ran.

    ``batch_size`` is the full batch: only batches of that size run compiled.
    ``compiler`` makes the compiled callable (``torch.compile`` by default).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        setting: str,
        device: torch.device,
        batch_size: int,
        compiler: Callable[[nn.Module], Callable[..., Any]] | None = None,
    ) -> None:
        self.model = model
        self.setting = setting
        self.device = device
        self.batch_size = batch_size
        self.compiler = compiler or torch.compile
        self.compiled: Callable[..., Any] | None = None
        self.failed = False
        if setting == "on":
            self.compile("TORCHYARD_COMPILE=on")

    @property
    def active(self) -> bool:
        return self.compiled is not None and not self.failed

    def compile(self, why: str) -> None:
        if self.compiled is None:
            log.info("training forward compiled with torch.compile (%s); the first steps compile it", why)
            self.compiled = self.compiler(self.model)

    def after_epoch(self, seconds_per_step: float, remaining_steps: int) -> None:
        """``auto`` on CUDA: compile for the rest of the job when it is long enough.

        Every rank calls this at the same epoch end; the ranks compile together or not at all.
        """
        if self.setting != "auto" or self.compiled is not None or self.device.type != "cuda":
            return
        if remaining_steps <= 0:
            return
        wanted = worth_compiling(seconds_per_step, remaining_steps)
        (votes,) = all_reduce_sum([1.0 if wanted else 0.0], self.device)
        if votes > 0:
            self.compile(f"about {seconds_per_step * remaining_steps / 60:.0f} min of training left")

    def __call__(self, batch: torch.Tensor) -> Any:
        if self.compiled is None or self.failed or batch.shape[0] != self.batch_size:
            return self.model(batch)
        try:
            return self.compiled(batch)
        except Exception as exc:  # a model torch.compile cannot handle trains on eagerly
            self.failed = True
            log.warning("torch.compile failed (%s: %s); training on without it", type(exc).__name__, exc)
            return self.model(batch)
