"""The learning-rate schedule: linear warm-up, then polynomial decay to zero.

The schedule is a pure function of the optimizer step count (:func:`lr_at`), so it is
unit-testable without an optimizer, and a resumed run only needs the step it resumes
at. The decay is linear (``POLY_POWER = 1.0``).
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

POLY_POWER = 1.0


def lr_at(step: int, total_steps: int, warmup_steps: int, base_lr: float, power: float = POLY_POWER) -> float:
    """Learning rate for iteration ``step`` (0-based count of optimizer steps already taken).

    - warm-up, ``step < warmup_steps``: ``base_lr * (step + 1) / warmup_steps`` (linear ramp
      whose last warm-up iteration uses ``base_lr``; the first one is not wasted at 0);
    - then ``base_lr * (1 - (step - warmup_steps) / (total_steps - warmup_steps)) ** power``,
      which reaches exactly 0 at ``step == total_steps``, i.e. once the last iteration
      (``total_steps - 1``) is done.
    """
    if total_steps <= 0:
        raise ValueError("total_steps must be positive")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError("warmup_steps must be within [0, total_steps]")
    step = max(0, step)
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps == 0 or step >= total_steps:
        return 0.0
    remaining = 1.0 - (step - warmup_steps) / decay_steps
    return base_lr * remaining**power


def build_scheduler(
    optimizer: Optimizer, *, base_lr: float, total_steps: int, warmup_steps: int, start_step: int = 0
) -> LambdaLR:
    """A per-iteration scheduler over ``optimizer`` (peak rate ``base_lr``) positioned at ``start_step``.

    Call ``scheduler.step()`` once after every ``optimizer.step()``. The position comes
    from the explicit step count, never from state carried in the optimizer.
    """
    for group in optimizer.param_groups:
        group["initial_lr"] = base_lr

    def factor(step: int) -> float:
        return lr_at(step, total_steps, warmup_steps, 1.0)

    return LambdaLR(optimizer, factor, last_epoch=start_step - 1)
