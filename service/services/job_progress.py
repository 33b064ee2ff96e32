"""A job's ``progress``: where it is (epoch, step, fraction) and when it should end (``eta_s``).

The job row keeps the latest progress a report brought (:func:`advanced`) with the API's
times of its recent steps; what users see (:func:`progress_public`) is computed from that
row alone, so a page of jobs costs no query of its own. The built-in trainer reports its
progress (epoch, steps so far and in all); a script job's comes from its metric points: the
highest step and epoch logged, of ``progress.total_steps`` steps when the script logs that
metric (docs/script-jobs.md).

``eta_s``: the steps left at the rate of the steps reported in the last
:data:`RATE_WINDOW_S` seconds, less the time since the last report; null until two reports
of one attempt are apart, and while the job is not running. A succeeded job is at 1.0 with
``eta_s`` 0 (an early stop included).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from torchyard.contract.metrics import TOTAL_STEPS_METRIC
from torchyard.contract.reports import MetricIn
from torchyard.contract.states import JobStatus

# The rate behind the ETA: the steps of the reports of the last few minutes.
RATE_WINDOW_S = 300.0
# The most report times kept on the row.
MAX_RECENT = 32
# Fields every job's progress has, null where unknown.
PUBLIC_FIELDS = ("epoch", "step", "fraction", "eta_s")
_PRIVATE = "recent"


def _fraction(step: int | None, total_steps: int | None) -> float | None:
    if step is None or not total_steps:
        return None
    return round(min(1.0, step / total_steps), 4)


def advanced(
    before: dict[str, Any] | None,
    *,
    attempt: int,
    epoch: int | None,
    epochs: int | None,
    step: int,
    total_steps: int | None,
    time: datetime,
    received: datetime,
) -> dict[str, Any]:
    """The job's stored progress after a report of ``step`` (``time``: when the run measured
    it; ``received``: the API's clock, which the rate is measured with)."""
    same = before is not None and before.get("attempt") == attempt
    at = received.timestamp()
    recent: list[list[float]] = []
    if same and before is not None:
        recent = [
            [float(t), float(s)]
            for t, s in before.get(_PRIVATE) or []
            if at - float(t) <= RATE_WINDOW_S and float(s) <= step
        ]
    recent.append([at, float(step)])
    return {
        "attempt": attempt,
        "epoch": epoch,
        "epochs": epochs,
        "step": step,
        "total_steps": total_steps,
        "fraction": _fraction(step, total_steps),
        "time": time.isoformat(),
        _PRIVATE: recent[-MAX_RECENT:],
    }


def from_script_metrics(
    before: dict[str, Any] | None, attempt: int, points: Sequence[MetricIn], received: datetime
) -> dict[str, Any] | None:
    """A script job's progress after a batch of its metric points (None: they say nothing new):
    the highest step and epoch of its points (the system metrics left out), of the latest
    ``progress.total_steps`` it logged."""
    same = before is not None and before.get("attempt") == attempt
    old = before if same and before is not None else {}
    total = old.get("total_steps")
    steps: list[int] = []
    epochs: list[int] = []
    latest = None
    for point in points:
        if point.name == TOTAL_STEPS_METRIC:
            total = int(point.value) if point.value >= 1 else None
        elif not point.name.startswith("sys."):
            steps.append(point.step)
            epochs.append(point.epoch)
            latest = point.time if latest is None or point.time > latest else latest
    if not steps and total == old.get("total_steps"):
        return None
    step = max([*steps, old.get("step") or 0])
    epoch = max([*epochs, old.get("epoch") or 0]) or None
    if steps and step == old.get("step") and total == old.get("total_steps") and epoch == old.get("epoch"):
        return None
    return advanced(
        before,
        attempt=attempt,
        epoch=epoch,
        epochs=None,
        step=step,
        total_steps=total,
        time=latest or received,
        received=received,
    )


def steps_per_second(recent: Iterable[Sequence[float]] | None) -> float | None:
    """The rate of the recent reports' steps (None with fewer than two apart in time)."""
    points = [(float(t), float(s)) for t, s in recent or []]
    if len(points) < 2:
        return None
    (t0, s0), (t1, s1) = points[0], points[-1]
    if t1 - t0 <= 0 or s1 <= s0:
        return None
    return (s1 - s0) / (t1 - t0)


def progress_public(status: str, stored: dict[str, Any] | None, now: datetime) -> dict[str, Any]:
    """What ``GET /v1/jobs`` shows of a job's progress: ``epoch``, ``step``, ``fraction`` and
    ``eta_s`` always (null where unknown), and the stored ``epochs``, ``total_steps``,
    ``attempt``, ``time`` and ``steps_per_s`` when there are."""
    out: dict[str, Any] = dict.fromkeys(PUBLIC_FIELDS)
    if stored:
        out.update({k: v for k, v in stored.items() if k != _PRIVATE})
        rate = steps_per_second(stored.get(_PRIVATE))
        out["steps_per_s"] = None if rate is None else round(rate, 4)
        total, step = stored.get("total_steps"), stored.get("step")
        recent = stored.get(_PRIVATE) or []
        if status == JobStatus.RUNNING and rate and total and step is not None and recent:
            since = now.timestamp() - float(recent[-1][0])
            out["eta_s"] = round(max(0.0, (total - step) / rate - max(0.0, since)), 1)
    if status == JobStatus.SUCCEEDED:
        out["fraction"], out["eta_s"] = 1.0, 0.0
    return out
