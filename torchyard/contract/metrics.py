"""The metric names a training job reports (docs/models.md), and the names a script job may use."""

from __future__ import annotations

import re
from typing import Literal, get_args

MetricName = Literal[
    "train.loss", "train.lr", "train.images_per_sec", "val.loss", "val.top1", "val.top5", "epoch.seconds"
]  # fmt: skip
METRIC_NAMES: frozenset[str] = frozenset(get_args(MetricName))
# Validation metrics, reported once an epoch.
VAL_METRICS: tuple[str, ...] = ("val.loss", "val.top1", "val.top5")

# Any name a script job logs (``torchyard.run.log_metric``): the built-in names match it too.
METRIC_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,63}$"
_METRIC_NAME = re.compile(METRIC_NAME_PATTERN)


def is_metric_name(name: object) -> bool:
    return isinstance(name, str) and _METRIC_NAME.match(name) is not None
