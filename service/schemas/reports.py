"""How users read back what worker agents reported (the batches themselves are in
``torchyard.contract.reports``; metric points and series in ``torchyard.contract.responses``)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from torchyard.contract.responses import MetricSeries


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


class MetricSeriesPage(BaseModel):
    series: dict[str, MetricSeries]
    points: int = Field(description="The most points asked for per metric.")
    last_seq: int = Field(
        description="The last metric seq these series include: continue with ``metrics?after=`` or "
        "the events stream resumed at ``s0.m<last_seq>.l0``."
    )
