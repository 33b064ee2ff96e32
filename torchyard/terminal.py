"""Terminal output of the CLI and the demo: tables, a progress bar, live job progress."""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TextIO

# The built-in trainer's metrics: (metric name, header, format). Any other metric (a
# script's) is headed by its name, its values to 4 significant digits.
EPOCH_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("train.loss", "train.loss", "{:.4f}"),
    ("train.lr", "lr", "{:.3g}"),
    ("train.images_per_sec", "img/s", "{:.1f}"),
    ("val.loss", "val.loss", "{:.4f}"),
    ("val.top1", "val.top1", "{:.2%}"),
    ("val.top5", "val.top5", "{:.2%}"),
    ("epoch.seconds", "seconds", "{:.1f}"),
)
OTHER_FORMAT = "{:.4g}"
_TRAINER_ORDER = {name: i for i, (name, _, _) in enumerate(EPOCH_COLUMNS)}
_TRAINER_COLUMNS = {c[0]: c for c in EPOCH_COLUMNS}

# Metrics where a higher value is a better model (a part of the name), and those where a
# lower one is; any other metric (time, learning rate, throughput) is not ranked.
_HIGHER_IS_BETTER = frozenset({"top1", "top5", "accuracy", "acc", "f1", "precision", "recall", "auc", "iou"})


def _part_goal(part: str) -> str | None:
    part = re.sub(r"_(step|epoch)$", "", part)  # Lightning's train_loss_step, val_acc_epoch
    if part.endswith("loss"):
        return "min"
    if part in _HIGHER_IS_BETTER or part.endswith(("_acc", "_accuracy", "_top1", "_top5", "_f1", "_auc")):
        return "max"
    return None


def quality_goal(metric: str) -> str | None:
    """``max`` for an accuracy, ``min`` for a loss, None for a metric that says nothing of
    how good a model is (``epoch.seconds``, ``train.lr``, ``train.images_per_sec``). The
    last part of the name says (``val.top1``, ``eval_loss``, ``val/acc``, Lightning's
    ``train_loss_step``), else any part (TensorBoard's ``Loss/train``)."""
    parts = re.split(r"[./:]", metric.lower())
    for part in (parts[-1], *parts[:-1]):
        goal = _part_goal(part)
        if goal is not None:
            return goal
    return None


def metric_columns(names: Iterable[str]) -> list[tuple[str, str, str]]:
    """(name, header, format) of each metric, in the order tables show them: losses, then
    accuracies, then the rest; the trainer's own in their usual order, any other by name."""

    def key(name: str) -> tuple[int, int, list[tuple[int, str]]]:
        goal = quality_goal(name)
        # Numbers in a name in their order (layer_2 before layer_10).
        natural = [(int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", name) if p]
        return (0 if goal == "min" else 1 if goal == "max" else 2, _TRAINER_ORDER.get(name, 99), natural)

    return [_TRAINER_COLUMNS.get(n, (n, n, OTHER_FORMAT)) for n in sorted(set(names), key=key)]


def output_width(stream: TextIO | None = None) -> int | None:
    """The columns that output to ``stream`` (default: stdout) has to fit: ``COLUMNS`` when
    set, else the terminal's width; None (no limit) for a pipe or a file."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    stream = stream or sys.stdout
    return shutil.get_terminal_size().columns if stream.isatty() else None


def more_metrics_note(hidden: Sequence[str], width: int) -> str:
    """The line under a table too narrow for every metric: how many more, which (as many
    names as fit in ``width``) and how to pick the columns."""
    head = f"+{len(hidden)} more metric{'s' if len(hidden) > 1 else ''}: "
    tail = " (pick columns with --name)"
    names = textwrap.shorten(", ".join(hidden), max(width - len(head) - len(tail) - 3, 12), placeholder=" …")
    return head + names + tail


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_time(value: datetime | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def format_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``-`` when unknown. No spaces, so a column of them
    splits cleanly."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "-"
    total = round(seconds)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def remaining_seconds(elapsed: float | None, fraction: float | None) -> float | None:
    """The time left if the rest goes at the pace so far: ``elapsed × (1 − f) / f``;
    None while nothing is done yet. An estimate: early stopping may end a job sooner."""
    if elapsed is None or fraction is None or fraction <= 0 or elapsed < 0:
        return None
    return 0.0 if fraction >= 1 else elapsed * (1 - fraction) / fraction


def timing_text(elapsed: float | None, left: float | None) -> str:
    """``elapsed 1m12s, about 48s left`` (the parts that are known)."""
    parts = []
    if elapsed is not None:
        parts.append(f"elapsed {format_duration(elapsed)}")
    if left is not None:
        parts.append(f"about {format_duration(left)} left")
    return ", ".join(parts)


def job_timing(
    started_at: datetime | None,
    finished_at: datetime | None,
    fraction: float | None,
    now: datetime | None = None,
) -> str:
    """How long a job has run and, while it runs, about how long it has left (from the
    fraction of its training steps done); empty before it started."""
    if started_at is None:
        return ""
    end = finished_at or now or datetime.now(started_at.tzinfo)
    elapsed = max(0.0, (end - started_at).total_seconds())
    if finished_at is not None:
        return f"took {format_duration(elapsed)}"
    return timing_text(elapsed, remaining_seconds(elapsed, fraction))


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain left-aligned table with a header line."""
    text_rows = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in text_rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


class ProgressBar:
    """A transfer progress bar on a terminal (stderr); silent when it is not a terminal."""

    def __init__(self, label: str, stream: TextIO | None = None, *, min_interval: float = 0.1) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.min_interval = min_interval
        self._last = 0.0
        self._started = time.monotonic()
        self._first_done: int | None = None
        self._shown = False

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if self._first_done is None:
            self._first_done = done
        if not self.enabled or (now - self._last < self.min_interval and done != total):
            return
        self._last = now
        rate = (done - self._first_done) / max(now - self._started, 1e-6)
        if total:
            width = 30
            filled = int(width * done / total)
            bar = "#" * filled + "." * (width - filled)
            text = f"{self.label} [{bar}] {done / total:6.1%} {human_bytes(done)}/{human_bytes(total)}"
        else:
            text = f"{self.label} {human_bytes(done)}"
        self.stream.write(f"\r{text}  {human_bytes(rate)}/s\x1b[K")
        self.stream.flush()
        self._shown = True

    def finish(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()


class EpochTable:
    """Metric points (rank 0's) folded into rows, each cell the last value of a metric in
    its row: a row per epoch where the job has epochs, else a row per step (a script that
    reports steps only: MLflow, TensorBoard). ``by="epoch"`` says the job has epochs (the
    trainer's); left None, the rows are epochs once the points span more than one epoch,
    steps until then."""

    def __init__(self, by: str | None = None) -> None:
        self.by = by
        self.epoch_rows: dict[int, dict[str, float]] = {}
        self.step_rows: dict[int, dict[str, float]] = {}
        self.names: set[str] = set()
        # Rows of each kind not yet handed out by ready(), and the last row of each kind.
        self._waiting: dict[str, set[int]] = {"epoch": set(), "step": set()}
        self._last: dict[str, int] = {}

    @property
    def kind(self) -> str:
        """``epoch`` or ``step``: what a row is."""
        if self.by is not None:
            return self.by
        return "epoch" if len(self.epoch_rows) > 1 else "step"

    @property
    def rows(self) -> dict[int, dict[str, float]]:
        return self.epoch_rows if self.kind == "epoch" else self.step_rows

    def add(self, point: Mapping[str, Any]) -> int:
        """Fold in one point; returns its epoch."""
        epoch = int(point["epoch"])
        if int(point.get("rank", 0)) != 0:
            return epoch
        name, value = str(point["name"]), float(point["value"])
        self.names.add(name)
        self._put("epoch", self.epoch_rows, epoch, name, value)
        if self.kind == "step":
            self._put("step", self.step_rows, int(point.get("step", 0)), name, value)
        elif self.step_rows:  # the job has epochs after all: its steps are not shown
            self.step_rows.clear()
            self._waiting["step"].clear()
        return epoch

    def _put(self, kind: str, rows: dict[int, dict[str, float]], key: int, name: str, value: float) -> None:
        if key not in rows:
            rows[key] = {}
            self._waiting[kind].add(key)
            self._last[kind] = max(key, self._last.get(kind, key))
        rows[key][name] = value

    def columns(self, names: Iterable[str] | None = None) -> list[tuple[str, str, str]]:
        return metric_columns(self.names if names is None else names)

    def row(self, key: int, columns: Sequence[tuple[str, str, str]] | None = None) -> list[str]:
        values = self.rows.get(key, {})
        cols = columns if columns is not None else self.columns()
        return [str(key)] + [fmt.format(values[name]) if name in values else "-" for name, _, fmt in cols]

    def render(self, width: int | None = None, *, last: int | None = None) -> str:
        """The table in at most ``width`` columns (every metric when None): the first
        columns that fit, and a note naming the rest; ``last`` rows only when given."""
        cols = self.columns()
        keys = sorted(self.rows)
        if last is not None:
            keys = keys[-last:] if last > 0 else []
        rows = [self.row(k, cols) for k in keys]
        shown = len(cols)
        if width is not None:
            widths = [max([len(h), *(len(r[i + 1]) for r in rows)]) for i, (_, h, _) in enumerate(cols)]
            used = max([len(self.kind), *(len(r[0]) for r in rows)])
            for i, w in enumerate(widths):
                if used + 2 + w > width:
                    shown = i
                    break
                used += 2 + w
        text = format_table([self.kind] + [h for _, h, _ in cols[:shown]], [r[: shown + 1] for r in rows])
        if shown < len(cols) and width is not None:
            text += "\n" + more_metrics_note([c[0] for c in cols[shown:]], width)
        return text

    def is_complete(self, epoch: int) -> bool:
        """An epoch has ended once its duration is recorded (the trainer's last point) or a
        later epoch has begun."""
        return epoch in self.epoch_rows and (
            "epoch.seconds" in self.epoch_rows[epoch] or epoch < self._last.get("epoch", epoch)
        )

    def ready(self, *, final: bool = False) -> list[int]:
        """The rows (of the kind shown now) not handed out before that are done: an epoch
        that :meth:`is_complete`, a step once a later one has a point; every row once the
        job ended (``final``). Each row is handed out once; when the rows turn into epochs,
        the epochs are handed out from the first."""
        kind = self.kind
        waiting = self._waiting[kind]
        last = self._last.get(kind)
        if kind == "epoch":
            done = [k for k in waiting if final or self.is_complete(k)]
        else:
            done = [k for k in waiting if final or (last is not None and k < last)]
        waiting.difference_update(done)
        return sorted(done)

    def timing(self, epoch: int, epochs: int | None) -> tuple[float | None, float | None]:
        """(elapsed, left) in seconds at the end of ``epoch``: the training time of the
        epochs so far (their recorded durations) and the time the remaining epochs of
        ``epochs`` take at that pace. None for what is unknown."""
        seconds = [
            row["epoch.seconds"]
            for e, row in self.epoch_rows.items()
            if e <= epoch and "epoch.seconds" in row
        ]
        if not seconds:
            return None, None
        elapsed = sum(seconds)
        return elapsed, remaining_seconds(elapsed, epoch / epochs if epochs else None)


# Width of a metric or time column in output that grows line by line: wide enough for
# every format of EPOCH_COLUMNS at ordinary magnitudes (0.000125, 1234.5, 100.00%).
VALUE_WIDTH = 8
# Width of the step column in such output.
STEP_WIDTH = 6


class EpochLines:
    """The metrics table as fixed-width lines printed one at a time (to a pipe or a file as
    much as to a terminal): columns and widths are settled with a header, so every later
    row lines up under it; a new header comes when the columns change (a new metric, the
    rows turning from steps into epochs). Rows of epochs end with the elapsed and left
    columns. In ``width`` columns (default: :func:`output_width`): the first metrics that
    fit, the others named in a note under the header."""

    def __init__(self, table: EpochTable, epochs: int | None, width: int | None = None) -> None:
        self.table = table
        self.epochs = epochs
        self.width = width or output_width()
        self._headed = False
        self._settle()

    def _settle(self) -> None:
        self.kind = self.table.kind
        self.names = set(self.table.names)
        timed = self.kind == "epoch"
        first = max(len("epoch"), len(str(self.epochs or 0))) if timed else STEP_WIDTH
        used = first + (2 * (2 + VALUE_WIDTH) if timed else 0)
        every = self.table.columns()
        self.columns: list[tuple[str, str, str]] = []
        for column in every:
            w = max(len(column[1]), VALUE_WIDTH)
            if self.columns and self.width is not None and used + 2 + w > self.width:
                break
            self.columns.append(column)
            used += 2 + w
        self.hidden = [c[0] for c in every[len(self.columns) :]]
        self.headers = [self.kind, *(h for _, h, _ in self.columns)] + (["elapsed", "left"] if timed else [])
        self.widths = [first] + [max(len(h), VALUE_WIDTH) for h in self.headers[1:]]

    def _line(self, cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, self.widths, strict=True)).rstrip()

    def header(self) -> str:
        return self._line(self.headers)

    def row(self, key: int) -> str:
        cells = self.table.row(key, self.columns)
        if self.kind == "epoch":
            elapsed, left = self.table.timing(key, self.epochs)
            cells += [format_duration(elapsed), format_duration(left)]
        return self._line(cells)

    def lines(self, key: int) -> list[str]:
        """A row's line, after a header where it is the first or the columns changed."""
        out: list[str] = []
        if not self._headed or self.kind != self.table.kind or self.names != self.table.names:
            before = (self.headers, self.hidden)
            self._settle()
            if not self._headed or (self.headers, self.hidden) != before:
                self._headed = True
                out.append(self.header())
                if self.hidden and self.width is not None:
                    out.append("-- " + more_metrics_note(self.hidden, self.width - 3))
        return [*out, self.row(key)]


def describe_status(data: Mapping[str, Any]) -> str:
    text = str(data.get("status"))
    if data.get("message"):
        text += f" ({data['message']})"
    failure = data.get("failure")
    if isinstance(failure, Mapping):
        where = ", ".join(f"{k} {failure[k]}" for k in ("rank", "node") if failure.get(k) is not None)
        text += f": {failure.get('code')}: {failure.get('message')}" + (f" [{where}]" if where else "")
    return text


class LiveProgress:
    """Prints a job's events as they arrive: status changes, a line per row of its metrics
    as the row ends (an epoch, or a step for a job without epochs: see :class:`EpochTable`),
    and (on a terminal) a refreshing line with the current step and training loss."""

    def __init__(
        self,
        out: TextIO | None = None,
        *,
        show_logs: bool = False,
        epochs: int | None = None,
        by: str | None = None,
        width: int | None = None,
    ) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self.show_logs = show_logs
        self.epochs = epochs
        # A job that says how many epochs it runs (the trainer's) counts by epoch.
        self.table = EpochTable(by=by or ("epoch" if epochs else None))
        self.width = width or output_width(self.out)
        self._live = False
        self.final: dict[str, Any] | None = None

    def _line(self, text: str) -> None:
        if self._live:
            self.out.write("\r\x1b[K")
            self._live = False
        self.out.write(text + "\n")
        self.out.flush()

    def _live_line(self, text: str) -> None:
        if not self.tty:
            return
        self.out.write("\r\x1b[K" + text)
        self.out.flush()
        self._live = True

    def _row_line(self, key: int) -> str:
        """``epoch 2/5  train.loss 0.5000  val.top1 81.25%  elapsed 20s  left 1m00s`` or
        ``step 400  loss 0.3125  accuracy 0.8``: the metrics that fit the width, then how
        many more."""
        values = self.table.rows.get(key, {})
        head = f"{self.table.kind} {key}"
        tail: list[str] = []
        if self.table.kind == "epoch":
            head += f"/{self.epochs}" if self.epochs else ""
            elapsed, left = self.table.timing(key, self.epochs)
            if elapsed is not None:
                tail.append(f"elapsed {format_duration(elapsed)}")
            if left is not None:
                tail.append(f"left {format_duration(left)}")
        columns = self.table.columns(values)
        parts = [f"{header} {fmt.format(values[name])}" for name, header, fmt in columns]
        whole = "  ".join([head, *parts, *tail])
        if self.width is None or len(whole) <= self.width:
            return whole
        # A line narrower than its metrics keeps the accuracies first: what a run is for.
        ranked = sorted(zip(columns, parts, strict=True), key=lambda cp: quality_goal(cp[0][0]) != "max")
        parts = [part for _, part in ranked]
        room = self.width - len("  ".join([head, *tail])) - 2
        shown: list[str] = []
        for i, part in enumerate(parts):
            rest = len(parts) - i - 1
            if shown and len("  ".join([*shown, part])) + (len(f"  +{rest} more") if rest else 0) > room:
                shown.append(f"+{len(parts) - i} more")
                break
            shown.append(part)
        return "  ".join([head, *shown, *tail])

    def handle(self, kind: str, data: Mapping[str, Any]) -> None:
        if kind == "status":
            # At the end every row seen is printed: a script's last epoch (or step) has
            # nothing after it to end it.
            self._print_rows(final=bool(data.get("final")))
            self._line(f"status: {describe_status(data)}")
            if data.get("final"):
                self.final = dict(data)
        elif kind == "metric":
            epoch = self.table.add(data)
            self._print_rows()
            if (
                self.table.kind == "epoch"
                and not self.table.is_complete(epoch)
                and data.get("name") == "train.loss"
            ):
                total = f"/{self.epochs}" if self.epochs else ""
                self._live_line(
                    f"epoch {epoch}{total}  step {data.get('step')}  train.loss {float(data['value']):.4f}"
                )
        elif kind == "log" and self.show_logs:
            text = str(data.get("text", "")).rstrip("\n")
            for line in text.splitlines():
                self._line(f"[{data.get('stream', 'log')}] {line}")

    def _print_rows(self, *, final: bool = False) -> None:
        for key in self.table.ready(final=final):
            self._line(self._row_line(key))
