"""Webhook request schemas (docs/webhooks.md); the answers are in
:mod:`torchyard.contract.webhooks`."""

from __future__ import annotations

from pydantic import Field

from service.schemas.common import StrictModel


class WebhookCreate(StrictModel):
    url: str = Field(
        min_length=1,
        max_length=2000,
        description="The http:// or https:// URL the events are POSTed to.",
    )
    events: list[str] = Field(
        max_length=32,
        description="The events to deliver (at least one): job.started, job.succeeded, job.failed, "
        "job.cancelled, job.preempted, sweep.best_changed, sweep.ended.",
    )
    team: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        description="A team of yours (not default): the events of every job and sweep of that team, "
        "whoever submitted it. Left out: the events of your own jobs and sweeps.",
    )
