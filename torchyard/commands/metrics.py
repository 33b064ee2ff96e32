"""``torchyard metrics`` (a per-epoch table, or live with ``--watch``) and ``compare``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torchyard.client import Client, Event, JobComparison, MetricPoint
from torchyard.commands.common import (
    _JOB_HELP,
    _client,
    _print_json,
    dataset_names,
    dataset_text,
)
from torchyard.terminal import (
    EpochLines,
    EpochTable,
    describe_status,
    format_duration,
    format_table,
    format_time,
    timing_text,
)


def _points_table(points: Iterable[MetricPoint]) -> str:
    rows = [(p.seq, p.name, f"{p.value:.6g}", p.epoch, p.step, p.rank, format_time(p.time)) for p in points]
    return format_table(["SEQ", "NAME", "VALUE", "EPOCH", "STEP", "RANK", "TIME"], rows)


def _metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.watch:
            return _watch_metrics(client, args)
        points = list(client.iter_metrics(args.id, name=args.name))
        if args.name and not args.watch:
            missing = sorted(set(args.name) - {p.name for p in points})
            if missing:
                known = sorted(client.metric_names(args.id))
                raise ValueError(
                    f"job {args.id} has no metric {', '.join(map(repr, missing))}; its metrics: "
                    + (", ".join(known) or "none yet")
                )
    if args.json:
        _print_json(points)
    elif args.name or args.raw:
        print(_points_table(points))
    else:
        table = EpochTable()
        for p in points:
            table.add(p.model_dump())
        print(table.render() if table.rows else "no metrics yet")
    return 0


def _compare(args: argparse.Namespace) -> int:
    with _client(args) as client:
        comparison = client.compare(args.ids, metrics=args.metric)
        if args.json:
            _print_json(comparison)
            return 0
        names = dataset_names(
            client,
            (j.parameters.get(k) for j in comparison.jobs for k in comparison.differing if _is_dataset(k)),
        )
    print(comparison_text(comparison, datasets=names))
    return 0


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


# Spec keys (as ``compare`` flattens them) that hold a dataset's id.
_DATASET_KEYS = frozenset({"train_dataset", "validation_dataset", "dataset"})


def _is_dataset(key: str) -> bool:
    return key in _DATASET_KEYS or key.startswith("inputs.")


# Metrics where a higher value is a better model (the last part of the name), and those
# where a lower one is; any other metric (time, learning rate, throughput) is not ranked.
_HIGHER_IS_BETTER = frozenset({"top1", "top5", "accuracy", "acc", "f1", "precision", "recall", "auc", "iou"})


def quality_goal(metric: str) -> str | None:
    """``max`` for an accuracy, ``min`` for a loss, None for a metric that says nothing of
    how good a model is (``epoch.seconds``, ``train.lr``, ``train.images_per_sec``)."""
    last = metric.rsplit(".", 1)[-1].lower()
    if last.endswith("loss"):
        return "min"
    if last in _HIGHER_IS_BETTER or last.endswith(("_acc", "_accuracy", "_top1", "_top5")):
        return "max"
    return None


def _ranked(comparison: JobComparison, metric: str) -> str | None:
    """The way a metric is ranked by ``compare``: a quality metric whose best value the
    service picked the same way; None for the others (their final value alone is shown)."""
    goal = quality_goal(metric)
    return goal if goal is not None and comparison.goals.get(metric, goal) == goal else None


def _best_text(metric: Any) -> str:
    best = metric.best if metric else None
    return "-" if best is None else f"{best.value:.4g} (epoch {best.epoch})"


def _final_text(metric: Any) -> str:
    final = metric.final if metric else None
    return "-" if final is None else f"{final.value:.4g}"


# The narrowest a column of ``compare`` is cut to before another layout is taken.
MIN_COLUMN = 8


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def fit_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int, shrink: Sequence[int] = ()
) -> str | None:
    """:func:`format_table` in at most ``width`` columns, cutting the cells of the
    ``shrink`` columns (widest first, down to :data:`MIN_COLUMN`) with ``…``; None when even
    that is too wide."""
    cells = [[_shown(v) if not isinstance(v, str) else v for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    floor = {i: max(len(headers[i]), MIN_COLUMN) for i in shrink}
    total = sum(widths) + 2 * (len(widths) - 1)
    while total > width:
        cuttable = [i for i in shrink if widths[i] > floor[i]]
        if not cuttable:
            return None
        widest = max(cuttable, key=lambda i: widths[i])
        widths[widest] -= 1
        total -= 1
    return format_table(headers, [[_cut(v, widths[i]) for i, v in enumerate(row)] for row in cells])


def comparison_text(
    comparison: JobComparison, *, width: int | None = None, datasets: Mapping[str, str] | None = None
) -> str:
    """What ``torchyard compare`` prints, in ``width`` columns (default: the terminal's):
    the parameters that differ (datasets by name), one row per job with its status,
    duration and images/s, and each metric's best (epoch) and final value: beside the jobs
    when that fits, else one row per metric and job. Only accuracies (highest best) and
    losses (lowest best) are ranked; other metrics show their final value."""
    width = width or shutil.get_terminal_size().columns
    jobs = comparison.jobs
    labels = [j.id[:8] for j in jobs]
    return "\n\n".join(
        [
            _parameters_text(comparison, labels, width, datasets or {}),
            _results_text(comparison, labels, width),
        ]
    )


def _parameter_cells(comparison: JobComparison, key: str, datasets: Mapping[str, str]) -> list[str]:
    values = [j.parameters.get(key) for j in comparison.jobs]
    if not _is_dataset(key):
        return [_shown(v) for v in values]
    # A name alone, unless two different datasets of the row share it.
    named = {v: datasets[v] for v in values if isinstance(v, str) and v in datasets}
    shared = {name for v, name in named.items() if any(w != v and n == name for w, n in named.items())}
    return [
        dataset_text(v, datasets, with_id=isinstance(v, str) and named.get(v, "") in shared) for v in values
    ]


def _parameters_text(
    comparison: JobComparison, labels: list[str], width: int, datasets: Mapping[str, str]
) -> str:
    if not comparison.differing:
        return "no parameter differs"
    cells = {key: _parameter_cells(comparison, key, datasets) for key in comparison.differing}
    rows = [[key, *cells[key]] for key in comparison.differing]
    wide = fit_table(["PARAMETER", *labels], rows, width)
    if wide is not None:
        return wide
    # Too wide with a column per job: a row per parameter and job, long values cut short.
    long = [
        [key if i == 0 else "", label, value]
        for key in comparison.differing
        for i, (label, value) in enumerate(zip(labels, cells[key], strict=True))
    ]
    return fit_table(["PARAMETER", "JOB", "VALUE"], long, width, shrink=(0, 2)) or format_table(
        ["PARAMETER", "JOB", "VALUE"], long
    )


def _results_text(comparison: JobComparison, labels: list[str], width: int) -> str:
    headers = ["JOB", "NAME", "STATUS", "DURATION", "IMAGES/S"]
    rows: list[list[str]] = [
        [
            label,
            job.name,
            job.status,
            format_duration(job.duration_s),
            "-" if job.images_per_sec is None else f"{job.images_per_sec:.1f}",
        ]
        for label, job in zip(labels, comparison.jobs, strict=True)
    ]
    goals = {name: _ranked(comparison, name) for name in comparison.metrics}
    # The ranked metrics (accuracies, losses) first, then the others, each in the given order.
    metrics = sorted(comparison.metrics, key=lambda name: goals[name] is None)
    wide_headers = list(headers)
    wide_rows = [list(row) for row in rows]
    for name in metrics:
        if goals[name]:
            wide_headers.append(f"{name} BEST ({goals[name]})")
        wide_headers.append(f"{name} FINAL")
        for row, job in zip(wide_rows, comparison.jobs, strict=True):
            metric = job.metrics.get(name)
            if goals[name]:
                row.append(_best_text(metric))
            row.append(_final_text(metric))
    wide = fit_table(wide_headers, wide_rows, width, shrink=(1,))
    if wide is not None:
        return wide
    jobs_table = fit_table(headers, rows, width, shrink=(1,)) or format_table(headers, rows)
    if not metrics:
        return jobs_table
    # Too wide with the metrics beside the jobs: a row per metric and job below them.
    metric_rows = [
        [
            (name + (f" ({goals[name]})" if goals[name] else "")) if i == 0 else "",
            label,
            _best_text(job.metrics.get(name)) if goals[name] else "",
            _final_text(job.metrics.get(name)),
        ]
        for name in metrics
        for i, (label, job) in enumerate(zip(labels, comparison.jobs, strict=True))
    ]
    metric_headers = ["METRIC", "JOB", "BEST", "FINAL"]
    metrics_table = fit_table(metric_headers, metric_rows, width, shrink=(0,)) or format_table(
        metric_headers, metric_rows
    )
    return f"{jobs_table}\n\n{metrics_table}"


def _watch_metrics(client: Client, args: argparse.Namespace) -> int:
    """Live table: redrawn in place on a terminal, one fixed-width line per finished epoch
    otherwise (a pipe or a file), each with the elapsed training time and the time left."""
    job = client.get_job(args.id)  # the full id, whatever the user typed, and the epoch count
    view = _MetricsView(job.id, job.parameters.get("epochs"), as_json=args.json)
    view.wait_reason = job.reason if job.status == "queued" else None
    for event in client.events(job.id, logs=False):
        if event.kind == "metric":
            if args.name and event.data.get("name") not in args.name:
                continue
            view.table.add(event.data)
            view.note_point(event.data)
        elif event.kind == "status":
            view.status = describe_status(event.data)
        view.emit(event)
    if not args.json and not view.tty:
        print(f"status: {view.status}")
    return 0


def requeue_note(event: Event) -> str | None:
    """The line shown when a job goes back to the queue (a restart or a preemption)."""
    if event.kind != "status" or not event.data.get("requeued"):
        return None
    return f"-- back in the queue: {event.data.get('message') or 'requeued'}"


class _MetricsView:
    """What ``metrics --watch`` shows of the events: JSON lines, a table redrawn in place on
    a terminal, or one line per finished epoch."""

    def __init__(self, job_id: str, epochs: Any, *, as_json: bool) -> None:
        self.job_id = job_id
        self.epochs = epochs
        self.as_json = as_json
        self.tty = sys.stdout.isatty() and not as_json
        self.table = EpochTable()
        self.status = "-"
        self.printed: set[int] = set()
        self.lines: EpochLines | None = None
        self.requeues: list[str] = []
        # The newest training step seen: (epoch, step, train.loss), shown until its epoch ends.
        self.step: tuple[int, int, float] | None = None
        self._step_shown_at: float | None = None
        # Why the job waits in the queue (the job's ``reason`` when the watch began), and
        # the last status a line was printed for (on a pipe or in a file).
        self.wait_reason: str | None = None
        self._status_shown: str | None = None

    def note_point(self, data: dict[str, Any]) -> None:
        if data.get("name") == "train.loss" and int(data.get("rank", 0)) == 0:
            self.step = (int(data["epoch"]), int(data.get("step", 0)), float(data["value"]))

    def step_text(self) -> str | None:
        """``epoch 0/5  step 40  train.loss 0.5321`` while an epoch is under way."""
        if self.step is None or self.table.is_complete(self.step[0]):
            return None
        epoch, step, loss = self.step
        total = f"/{self.epochs}" if self.epochs else ""
        return f"epoch {epoch}{total}  step {step}  train.loss {loss:.4f}"

    def redraw(self) -> None:
        table, epochs = self.table, self.epochs
        done = [e for e in sorted(table.rows) if table.is_complete(e)]
        where = ""
        if done:
            timing = timing_text(*table.timing(done[-1], epochs))
            where = (
                f"  epoch {done[-1]}" + (f"/{epochs}" if epochs else "") + (f"  {timing}" if timing else "")
            )
        sys.stdout.write("\x1b[H\x1b[2J")
        notes = "".join(f"{line}\n" for line in self.requeues[-3:])
        current = self.step_text()
        if current:
            notes += f"now: {current}\n"
        sys.stdout.write(f"job {self.job_id}  status {self.status}{where}\n{notes}\n{table.render()}\n")
        sys.stdout.flush()

    def emit(self, event: Event) -> None:
        if self.as_json:
            print(json.dumps({"event": event.kind, "id": event.id, "data": event.data}), flush=True)
            return
        requeue = requeue_note(event)
        if requeue:
            self.requeues.append(requeue)
        if self.tty:
            self.redraw()
            return
        if requeue:
            print(requeue, flush=True)
        self._print_status(event, shown=requeue is not None)
        self._print_step()
        for epoch in sorted(self.table.rows):
            if epoch in self.printed or not (self.table.is_complete(epoch) or event.is_final):
                continue
            if self.lines is None:
                self.lines = EpochLines(self.table, self.epochs)
                print(self.lines.header())
            print(self.lines.row(epoch), flush=True)
            self.printed.add(epoch)

    def _print_status(self, event: Event, *, shown: bool) -> None:
        """A line for each status the job goes through before it ends (``-- job ID queued
        (waiting for ...)``), once per change: what a terminal shows at the top of its table
        (the final status has its own line at the end)."""
        if event.kind != "status" or event.is_final:
            return
        status = str(event.data.get("status"))
        if status == self._status_shown:
            return
        self._status_shown = status
        if shown:  # a requeue has its own line
            return
        text = describe_status(event.data)
        if status == "queued" and self.wait_reason:
            text = f"queued ({self.wait_reason})"
        print(f"-- job {self.job_id} {text}", flush=True)

    def _print_step(self) -> None:
        """A line with the step reached, while no epoch has ended yet or an epoch is long:
        the first one at once, then at most one per :data:`STEP_LINE_INTERVAL_S`."""
        current = self.step_text()
        now = time.monotonic()
        if current is None or (
            self._step_shown_at is not None and now - self._step_shown_at < STEP_LINE_INTERVAL_S
        ):
            return
        self._step_shown_at = now
        print(f"-- {current}", flush=True)


# Least time between two step lines of `metrics --watch` on a pipe or in a file.
STEP_LINE_INTERVAL_S = 30.0


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``metrics`` and ``compare``."""
    metrics = sub.add_parser("metrics", parents=[common], help="a job's metrics as a per-epoch table")
    metrics.add_argument("id", metavar="JOB", help=_JOB_HELP)
    metrics.add_argument("--watch", "-w", action="store_true", help="refresh live until the job ends")
    metrics.add_argument("--name", action="append", help="only this metric (repeatable); lists the points")
    metrics.add_argument("--raw", action="store_true", help="list every point instead of the epoch table")
    metrics.set_defaults(handler=_metrics)

    compare = sub.add_parser(
        "compare",
        parents=[common],
        help="several jobs side by side: the parameters that differ and each metric's best and final value",
    )
    compare.add_argument("ids", nargs="+", metavar="JOB", help="up to 20 jobs: ids, names or id prefixes")
    compare.add_argument("--metric", action="append", help="only this metric (repeatable; default: all)")
    compare.set_defaults(handler=_compare)
