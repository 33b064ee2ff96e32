"""Terminal output of the CLI and the demo: tables, a progress bar, live job progress."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TextIO

# Per-epoch columns of the metrics table: (metric name, header, format).
EPOCH_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("train.loss", "train.loss", "{:.4f}"),
    ("train.lr", "lr", "{:.3g}"),
    ("train.images_per_sec", "img/s", "{:.1f}"),
    ("val.loss", "val.loss", "{:.4f}"),
    ("val.top1", "val.top1", "{:.2%}"),
    ("val.top5", "val.top5", "{:.2%}"),
    ("epoch.seconds", "seconds", "{:.1f}"),
)


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


@dataclass
class EpochTable:
    """Metric points folded into one row per epoch (the last value of each metric)."""

    rows: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, point: Mapping[str, Any]) -> int:
        epoch = int(point["epoch"])
        if int(point.get("rank", 0)) == 0:
            self.rows.setdefault(epoch, {})[str(point["name"])] = float(point["value"])
        return epoch

    def columns(self) -> list[tuple[str, str, str]]:
        present = {name for row in self.rows.values() for name in row}
        return [c for c in EPOCH_COLUMNS if c[0] in present]

    def row(self, epoch: int, columns: Sequence[tuple[str, str, str]] | None = None) -> list[str]:
        values = self.rows.get(epoch, {})
        cols = columns if columns is not None else self.columns()
        return [str(epoch)] + [fmt.format(values[name]) if name in values else "-" for name, _, fmt in cols]

    def render(self) -> str:
        cols = self.columns()
        return format_table(
            ["epoch"] + [h for _, h, _ in cols], [self.row(e, cols) for e in sorted(self.rows)]
        )

    def is_complete(self, epoch: int) -> bool:
        """An epoch's row is complete once its duration is recorded (the trainer's last point)."""
        return "epoch.seconds" in self.rows.get(epoch, {})

    def timing(self, epoch: int, epochs: int | None) -> tuple[float | None, float | None]:
        """(elapsed, left) in seconds at the end of ``epoch``: the training time of the
        epochs so far (their recorded durations) and the time the remaining epochs of
        ``epochs`` take at that pace. None for what is unknown."""
        seconds = [
            row["epoch.seconds"] for e, row in self.rows.items() if e <= epoch and "epoch.seconds" in row
        ]
        if not seconds:
            return None, None
        elapsed = sum(seconds)
        return elapsed, remaining_seconds(elapsed, epoch / epochs if epochs else None)


# Width of a metric or time column in output that grows line by line: wide enough for
# every format of EPOCH_COLUMNS at ordinary magnitudes (0.000125, 1234.5, 100.00%).
VALUE_WIDTH = 8


class EpochLines:
    """The per-epoch table as fixed-width lines printed one at a time (to a pipe or a
    file as much as to a terminal): columns and widths are settled with the header, so
    every later row lines up under it. Ends with the elapsed and left columns."""

    def __init__(self, table: EpochTable, epochs: int | None) -> None:
        self.table = table
        self.epochs = epochs
        self.columns = table.columns()
        self.headers = ["epoch", *(h for _, h, _ in self.columns), "elapsed", "left"]
        self.widths = [max(len("epoch"), len(str(epochs or 0)))] + [
            max(len(h), VALUE_WIDTH) for h in self.headers[1:]
        ]

    def _line(self, cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, self.widths, strict=True)).rstrip()

    def header(self) -> str:
        return self._line(self.headers)

    def row(self, epoch: int) -> str:
        elapsed, left = self.table.timing(epoch, self.epochs)
        cells = [*self.table.row(epoch, self.columns), format_duration(elapsed), format_duration(left)]
        return self._line(cells)


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
    """Prints a job's events as they arrive: status changes, one line per finished epoch,
    and (on a terminal) a refreshing line with the current step and training loss."""

    def __init__(
        self, out: TextIO | None = None, *, show_logs: bool = False, epochs: int | None = None
    ) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self.show_logs = show_logs
        self.epochs = epochs
        self.table = EpochTable()
        self._printed: set[int] = set()
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

    def _epoch_line(self, epoch: int) -> str:
        values = self.table.rows.get(epoch, {})
        parts = [f"epoch {epoch}" + (f"/{self.epochs}" if self.epochs else "")]
        for name, header, fmt in EPOCH_COLUMNS:
            if name in values:
                parts.append(f"{header} {fmt.format(values[name])}")
        elapsed, left = self.table.timing(epoch, self.epochs)
        if elapsed is not None:
            parts.append(f"elapsed {format_duration(elapsed)}")
        if left is not None:
            parts.append(f"left {format_duration(left)}")
        return "  ".join(parts)

    def handle(self, kind: str, data: Mapping[str, Any]) -> None:
        if kind == "status":
            # At the end every epoch seen is printed: a script's metrics have no epoch
            # duration, so its last epoch is never "complete" by the trainer's rule.
            self._flush_epochs(every=bool(data.get("final")))
            self._line(f"status: {describe_status(data)}")
            if data.get("final"):
                self.final = dict(data)
        elif kind == "metric":
            epoch = self.table.add(data)
            for done in sorted(self.table.rows):
                if done < epoch:
                    self._print_epoch(done)
            if self.table.is_complete(epoch):
                self._print_epoch(epoch)
            elif data.get("name") == "train.loss":
                total = f"/{self.epochs}" if self.epochs else ""
                self._live_line(
                    f"epoch {epoch}{total}  step {data.get('step')}  train.loss {float(data['value']):.4f}"
                )
        elif kind == "log" and self.show_logs:
            text = str(data.get("text", "")).rstrip("\n")
            for line in text.splitlines():
                self._line(f"[{data.get('stream', 'log')}] {line}")

    def _print_epoch(self, epoch: int) -> None:
        if epoch not in self._printed:
            self._printed.add(epoch)
            self._line(self._epoch_line(epoch))

    def _flush_epochs(self, *, every: bool = False) -> None:
        for epoch in sorted(self.table.rows):
            if every or self.table.is_complete(epoch):
                self._print_epoch(epoch)
