"""Sweeps (hyperparameter searches): submit, list, get, cancel."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from torchyard.apiclient.models import ApiModel, Page
from torchyard.apiclient.transport import Transport, segment


class Trial(ApiModel):
    number: int
    job_id: str
    params: dict[str, Any] = {}
    state: str
    job_status: str | None = None
    value: float | None = None
    epochs: int = 0
    intermediate: dict[str, float] = {}
    reason: str | None = None
    created_at: datetime | None = None
    finished_at: datetime | None = None


class Sweep(ApiModel):
    id: str
    name: str
    status: str
    type: str = "train"
    job: dict[str, Any] = {}
    search_space: dict[str, Any] = {}
    objective: dict[str, Any] = {}
    algorithm: str = ""
    early_stopping: dict[str, Any] | None = None
    max_trials: int = 0
    max_concurrent_trials: int = 0
    seed: int = 0
    message: str | None = None
    trial_counts: dict[str, int] = {}
    best_trial: Trial | None = None
    trials: list[Trial] | None = None
    epochs_run: int = 0
    created_at: datetime | None = None
    finished_at: datetime | None = None


class SweepCalls:
    """The ``/v1/sweeps`` routes."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def submit_sweep(self, spec: Mapping[str, Any]) -> Sweep:
        """Start a hyperparameter search (docs/sweeps.md shape); its first trials are queued as jobs."""
        return Sweep.model_validate(self._transport.json("POST", "/v1/sweeps", json=dict(spec)))

    def list_sweeps(
        self,
        *,
        status: str | Sequence[str] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[Sweep]:
        params: dict[str, Any] = {}
        if status:
            params["status"] = [status] if isinstance(status, str) else list(status)
        if limit is not None:
            params["limit"] = limit
        if cursor:
            params["cursor"] = cursor
        return Page[Sweep].model_validate(self._transport.json("GET", "/v1/sweeps", params=params))

    def get_sweep(self, sweep_id: str) -> Sweep:
        """The sweep (id, name or id prefix) with every trial and ``best_trial``."""
        return Sweep.model_validate(self._transport.json("GET", f"/v1/sweeps/{segment(sweep_id)}"))

    def cancel_sweep(self, sweep_id: str) -> Sweep:
        """Idempotent: no more trials, and every live trial's job is cancelled."""
        return Sweep.model_validate(self._transport.json("POST", f"/v1/sweeps/{segment(sweep_id)}/cancel"))
