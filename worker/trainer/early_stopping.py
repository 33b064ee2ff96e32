"""Early stopping on the validation loss."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class EarlyStopping:
    """Tracks the best (lowest) validation loss and how many epochs passed without a new one.

    ``update`` returns True when the epoch is a new best; ``should_stop`` becomes True
    after ``patience`` consecutive epochs without improvement.
    """

    patience: int
    best_loss: float = math.inf
    best_epoch: int = 0
    epochs_without_improvement: int = 0

    def update(self, val_loss: float, epoch: int) -> bool:
        if val_loss < self.best_loss:
            self.best_loss = val_loss
            self.best_epoch = epoch
            self.epochs_without_improvement = 0
            return True
        self.epochs_without_improvement += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.epochs_without_improvement >= self.patience

    def state_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.best_loss = float(state["best_loss"])
        self.best_epoch = int(state["best_epoch"])
        self.epochs_without_improvement = int(state["epochs_without_improvement"])
