"""How users read back what worker agents reported (the batches themselves are in
``torchyard.contract.reports``)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class MetricPoint(BaseModel):
    seq: int = Field(description="Position in the job's metric history; pass it as ``after`` to continue.")
    name: str = Field(description="A trainer metric (docs/models.md) or a name a script job logged.")
    value: float
    epoch: int
    step: int
    rank: int
    time: datetime
    attempt: int


class MetricPage(BaseModel):
    items: list[MetricPoint]
    next_after: int = Field(
        description="The cursor for the next poll: the last item's seq, or the given after."
    )


class LogStream(BaseModel):
    name: str = Field(
        description="``rank-<N>``, ``agent-<node>`` or, for a script job's ``./logs`` files, "
        "``file-<node rank>/<path>``."
    )
    size: int = Field(description="Bytes received so far.")
    rank: int | None = None
    node: str | None = None


class LogStreams(BaseModel):
    attempt: int | None = Field(description="The attempt these streams belong to (None before the first).")
    complete: bool = Field(description="True when nothing more will be written to these streams.")
    streams: list[LogStream]


class ModelUploaded(BaseModel):
    sha256: str
    size: int
    files: dict[str, str] = Field(description="sha256 of every file of the model directory.")


class MetricSeries(BaseModel):
    x: list[float] = Field(
        description="The training step of each point (a stretch's middle step when reduced)."
    )
    y: list[float]
    count: int = Field(description="Points stored for this metric, before reduction.")


class MetricSeriesPage(BaseModel):
    series: dict[str, MetricSeries]
    points: int = Field(description="The most points asked for per metric.")
    last_seq: int = Field(
        description="The last metric seq these series include: continue with ``metrics?after=`` or "
        "the events stream resumed at ``s0.m<last_seq>.l0``."
    )
