from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from service.api.deps import CurrentUser, ReadSessionDep, SessionDep, SettingsDep, WakeupDep
from service.api.routing import SessionScopedRoute
from service.schemas.sweeps import SweepCreate, SweepImportance, SweepList, SweepPublic
from service.services import sweep_importance, sweep_views
from service.services import sweeps as sweeps_service
from service.states import SweepStatus

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"], route_class=SessionScopedRoute)


@router.post("", status_code=status.HTTP_201_CREATED)
def submit_sweep(
    body: SweepCreate, session: SessionDep, settings: SettingsDep, wakeup: WakeupDep, user: CurrentUser
) -> SweepPublic:
    """Start a hyperparameter search: a base job (train or script), a search space of dotted
    paths into it (each validated against the job spec's own ranges: a 422 names the key and
    the range), an objective, an algorithm (random, grid, tpe) and an early-stopping rule
    (asha, median or null). 201 with the sweep; its first trials are queued as jobs."""
    sweep = sweeps_service.create_sweep(session, settings, user, body)
    wakeup.notify()
    return sweep_views.sweeps_public(session, [sweep], detail=True)[0]


@router.get("")
def list_sweeps(
    session: ReadSessionDep,
    user: CurrentUser,
    status_: Annotated[list[SweepStatus] | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
) -> SweepList:
    """Sweeps newest first (without their trials); follow ``next_cursor`` for more."""
    rows, next_cursor = sweeps_service.list_sweeps(
        session, user, statuses=status_, limit=limit, cursor=cursor
    )
    return SweepList(items=sweep_views.sweeps_public(session, rows, detail=False), next_cursor=next_cursor)


@router.get("/{sweep_id}")
def get_sweep(sweep_id: str, session: ReadSessionDep, user: CurrentUser) -> SweepPublic:
    """Status, every trial (parameters, state, objective value, epochs run) and ``best_trial``."""
    sweep = sweeps_service.get_sweep(session, user, sweep_id)
    return sweep_views.sweeps_public(session, [sweep], detail=True)[0]


@router.get("/{sweep_id}/importance")
def get_sweep_importance(sweep_id: str, session: ReadSessionDep, user: CurrentUser) -> SweepImportance:
    """How much each search-space key mattered to the objective: Optuna's parameter importances
    (PED-ANOVA) over the completed trials, largest first; null until two trials completed."""
    return sweep_importance.importance(session, user, sweep_id)


@router.post("/{sweep_id}/cancel")
def cancel_sweep(sweep_id: str, session: SessionDep, user: CurrentUser) -> SweepPublic:
    """Idempotent: no trial is started any more and every live trial's job is cancelled."""
    sweep = sweeps_service.cancel_sweep(session, user, sweep_id)
    return sweep_views.sweeps_public(session, [sweep], detail=True)[0]
