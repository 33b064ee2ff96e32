"""``torchyard metrics`` (a per-epoch table, or live with ``--watch``) and ``compare``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from typing import Any

from torchyard.client import Client, Event, JobComparison, MetricPoint
from torchyard.commands.common import _JOB_HELP, _answer, _client, _print_json
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
    return _answer(args, comparison, comparison_text(comparison))


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


def comparison_text(comparison: JobComparison) -> str:
    """What ``torchyard compare`` prints: the parameters that differ, then one row per job
    with its status, duration, images/s and each metric's best (epoch) and final value."""
    jobs = comparison.jobs
    labels = [j.id[:8] for j in jobs]
    if comparison.differing:
        rows = [[key, *(_shown(j.parameters.get(key)) for j in jobs)] for key in comparison.differing]
        parameters = format_table(["PARAMETER", *labels], rows)
    else:
        parameters = "no parameter differs"
    headers = ["JOB", "NAME", "STATUS", "DURATION", "IMAGES/S"]
    for name in comparison.metrics:
        goal = comparison.goals.get(name, "max")
        headers += [f"{name} BEST ({goal})", f"{name} FINAL"]
    rows = []
    for label, job in zip(labels, jobs, strict=True):
        row: list[Any] = [
            label,
            job.name,
            job.status,
            format_duration(job.duration_s),
            "-" if job.images_per_sec is None else f"{job.images_per_sec:.1f}",
        ]
        for name in comparison.metrics:
            metric = job.metrics.get(name)
            best = metric.best if metric else None
            final = metric.final if metric else None
            row.append("-" if best is None else f"{best.value:.4g} (epoch {best.epoch})")
            row.append("-" if final is None else f"{final.value:.4g}")
        rows.append(row)
    return f"{parameters}\n\n{format_table(headers, rows)}"


def _watch_metrics(client: Client, args: argparse.Namespace) -> int:
    """Live table: redrawn in place on a terminal, one fixed-width line per finished epoch
    otherwise (a pipe or a file), each with the elapsed training time and the time left."""
    job = client.get_job(args.id)  # the full id, whatever the user typed, and the epoch count
    view = _MetricsView(job.id, job.parameters.get("epochs"), as_json=args.json)
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
        self._print_step()
        for epoch in sorted(self.table.rows):
            if epoch in self.printed or not (self.table.is_complete(epoch) or event.is_final):
                continue
            if self.lines is None:
                self.lines = EpochLines(self.table, self.epochs)
                print(self.lines.header())
            print(self.lines.row(epoch), flush=True)
            self.printed.add(epoch)

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
