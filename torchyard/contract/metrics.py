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


# Each rank's system metrics (docs/operations.md, "System metrics"): every rank of the built-in
# trainer samples itself and appends them to its file in the run folder, which its agent ships.
SYS_METRIC_NAMES: tuple[str, ...] = (
    "sys.cpu_percent",
    "sys.rss_bytes",
    "sys.gpu_util",
    "sys.gpu_memory_bytes",
    "sys.input_wait_fraction",
)
SYS_METRICS_FILE_PATTERN = "sys-rank-*.jsonl"
# A script job may log its planned number of steps under this name: its progress then has a fraction.
TOTAL_STEPS_METRIC = "progress.total_steps"


def sys_metrics_file(rank: int) -> str:
    """The run folder's file of rank ``rank``'s system metrics."""
    return f"sys-rank-{rank}.jsonl"
