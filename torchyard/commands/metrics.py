"""``torchyard metrics`` (a table by epoch, or by step for a job without epochs; live with
``--watch``) and ``compare``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torchyard.apiclient.models import ComparedJob, ComparedMetric
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
    output_width,
    quality_goal,
    timing_text,
)


def _points_table(points: Iterable[MetricPoint]) -> str:
    rows = [(p.seq, p.name, f"{p.value:.6g}", p.epoch, p.step, p.rank, format_time(p.time)) for p in points]
    return format_table(["SEQ", "NAME", "VALUE", "EPOCH", "STEP", "RANK", "TIME"], rows)


def _counted_by(job_type: str) -> str | None:
    """What a job's metrics table is counted by from the start: the trainer's jobs by
    epoch; any other job by what its points turn out to span (:class:`EpochTable`)."""
    return "epoch" if job_type == "train" else None


def _metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.watch:
            return _watch_metrics(client, args)
        table_only = not (args.json or args.raw)
        job = client.get_job(args.id) if table_only else None
        points = list(client.iter_metrics(job.id if job else args.id, name=args.name))
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
    elif args.raw or job is None:
        print(_points_table(points))
    else:
        table = EpochTable(by=_counted_by(job.type))
        for p in points:
            table.add(p.model_dump())
        print(table.render(output_width()) if table.rows else "no metrics yet")
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


def _ranked(comparison: JobComparison, metric: str) -> str | None:
    """The way a metric is ranked by ``compare``: a quality metric whose best value the
    service picked the same way; None for the others (their final value alone is shown)."""
    goal = quality_goal(metric)
    return goal if goal is not None and comparison.goals.get(metric, goal) == goal else None


def _best_text(job: ComparedJob, metric: ComparedMetric | None) -> str:
    """``0.83 (epoch 3)``, or ``0.83 (step 400)`` for a job that counts steps only."""
    best = metric.best if metric else None
    if best is None:
        return "-"
    by = job.counted_by
    return f"{best.value:.4g} ({by} {best.epoch if by == 'epoch' else best.step})"


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
    the parameters that differ (datasets by name) and then what the jobs' MLflow runs logged
    that differs (``mlflow: lr``), one row per job with its status, duration and images/s,
    and each metric's best (with its epoch, or its step for a job without epochs) and final
    value: beside the jobs when that fits, else one row per metric and job. Only accuracies
    (highest best) and losses (lowest best) are ranked; other metrics show their final
    value."""
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
    if key in comparison.logged_differing:  # what an MLflow run logged: text as logged
        return [_shown(j.logged.get(key)) for j in comparison.jobs]
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
    keys = [*comparison.differing, *comparison.logged_differing]
    if not keys:
        return "no parameter differs"
    cells = {key: _parameter_cells(comparison, key, datasets) for key in keys}
    rows = [[key, *cells[key]] for key in keys]
    wide = fit_table(["PARAMETER", *labels], rows, width)
    if wide is not None:
        return wide
    # Too wide with a column per job: a row per parameter and job, long values cut short.
    long = [
        [key if i == 0 else "", label, value]
        for key in keys
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
                row.append(_best_text(job, metric))
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
            _best_text(job, job.metrics.get(name)) if goals[name] else "",
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
    """Live table: redrawn in place on a terminal, one fixed-width line per finished row
    otherwise (a pipe or a file): an epoch, with the elapsed training time and the time
    left, or a step for a job without epochs."""
    job = client.get_job(args.id)  # the full id, whatever the user typed, and the epoch count
    view = _MetricsView(job.id, job.parameters.get("epochs"), as_json=args.json, by=_counted_by(job.type))
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
    a terminal, or one line per finished row (an epoch, or a step for a job without epochs)."""

    def __init__(self, job_id: str, epochs: Any, *, as_json: bool, by: str | None = None) -> None:
        self.job_id = job_id
        self.epochs = epochs
        self.as_json = as_json
        self.tty = sys.stdout.isatty() and not as_json
        self.table = EpochTable(by=by)
        self.status = "-"
        self.lines: EpochLines | None = None
        self.requeues: list[str] = []
        # The newest training step seen: (epoch, step, loss), shown until its epoch ends; the
        # loss is train.loss, else the first metric seen that is a loss.
        self.step: tuple[int, int, float] | None = None
        self.step_metric: str | None = None
        self._step_shown_at: float | None = None
        # Why the job waits in the queue (the job's ``reason`` when the watch began), and
        # the last status a line was printed for (on a pipe or in a file).
        self.wait_reason: str | None = None
        self._status_shown: str | None = None

    def note_point(self, data: dict[str, Any]) -> None:
        name = str(data.get("name"))
        if int(data.get("rank", 0)) != 0:
            return
        if self.step_metric != "train.loss" and (
            name == "train.loss" or (self.step_metric is None and quality_goal(name) == "min")
        ):
            self.step_metric = name
        if name == self.step_metric:
            self.step = (int(data["epoch"]), int(data.get("step", 0)), float(data["value"]))

    def step_text(self) -> str | None:
        """``epoch 0/5  step 40  train.loss 0.5321`` while an epoch is under way (a job
        without epochs has a row per step: no such line)."""
        if self.step is None or self.table.kind != "epoch" or self.table.is_complete(self.step[0]):
            return None
        epoch, step, loss = self.step
        total = f"/{self.epochs}" if self.epochs else ""
        return f"epoch {epoch}{total}  step {step}  {self.step_metric} {loss:.4f}"

    def redraw(self) -> None:
        table, epochs = self.table, self.epochs
        where = ""
        if table.kind == "epoch":
            done = [e for e in sorted(table.rows) if table.is_complete(e)]
            if done:
                timing = timing_text(*table.timing(done[-1], epochs))
                where = (
                    f"  epoch {done[-1]}"
                    + (f"/{epochs}" if epochs else "")
                    + (f"  {timing}" if timing else "")
                )
        elif table.rows:
            where = f"  step {max(table.rows)}"
        sys.stdout.write("\x1b[H\x1b[2J")
        notes = "".join(f"{line}\n" for line in self.requeues[-3:])
        current = self.step_text()
        if current:
            notes += f"now: {current}\n"
        # The newest rows that fit the terminal's height below these lines.
        size = shutil.get_terminal_size()
        room = size.lines - 5 - notes.count("\n")
        sys.stdout.write(
            f"job {self.job_id}  status {self.status}{where}\n{notes}\n"
            f"{table.render(size.columns, last=max(room, 1))}\n"
        )
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
        for key in self.table.ready(final=event.is_final):
            if self.lines is None:
                self.lines = EpochLines(self.table, self.epochs)
            print("\n".join(self.lines.lines(key)), flush=True)

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
    metrics = sub.add_parser(
        "metrics",
        parents=[common],
        help="a job's metrics as a table: a row per epoch, or per step for a job without epochs",
        description="A job's metrics as a table: a row per epoch where the job has epochs (the "
        "trainer's jobs, or any job whose points span more than one epoch), else a row per step; "
        "a column per metric, losses and accuracies first, as many as the terminal's width holds "
        "(a note names the others: pick columns with --name).",
    )
    metrics.add_argument("id", metavar="JOB", help=_JOB_HELP)
    metrics.add_argument("--watch", "-w", action="store_true", help="refresh live until the job ends")
    metrics.add_argument(
        "--name",
        action="append",
        help="only this metric (repeatable): the table's columns, or the points listed",
    )
    metrics.add_argument("--raw", action="store_true", help="list every point instead of the table")
    metrics.set_defaults(handler=_metrics)

    compare = sub.add_parser(
        "compare",
        parents=[common],
        help="several jobs side by side: the parameters that differ and each metric's best and final value",
    )
    compare.add_argument("ids", nargs="+", metavar="JOB", help="up to 20 jobs: ids, names or id prefixes")
    compare.add_argument("--metric", action="append", help="only this metric (repeatable; default: all)")
    compare.set_defaults(handler=_compare)
