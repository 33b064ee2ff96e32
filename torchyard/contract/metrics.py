"""The metric names a training job reports (SPEC §4)."""

from __future__ import annotations

from typing import Literal, get_args

MetricName = Literal[
    "train.loss", "train.lr", "train.images_per_sec", "val.loss", "val.top1", "val.top5", "epoch.seconds"
]  # fmt: skip
METRIC_NAMES: frozenset[str] = frozenset(get_args(MetricName))
# Validation metrics, reported once an epoch.
VAL_METRICS: tuple[str, ...] = ("val.loss", "val.top1", "val.top5")
