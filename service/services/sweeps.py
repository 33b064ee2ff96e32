"""Sweeps (docs/sweeps.md): hyperparameter search over ordinary jobs, decided by Optuna.

The requests: submit a sweep (checked by :mod:`sweep_validation`, its first trials queued
by :mod:`sweep_trials`), find one, list them, cancel one. The decisions are taken in
:mod:`sweep_rounds`; users see sweeps as :mod:`sweep_views` shapes them.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Sweep
from service.db.types import utcnow
from service.schemas.jobs import TrainJobCreate
from service.schemas.sweeps import SweepCreate
from service.services import refs
from service.services.ownership import owned, owns
from service.services.sweep_rounds import stop
from service.services.sweep_trials import create_trials
from service.services.sweep_validation import validate
from service.services.teams import team_for_submission
from service.services.tokens import Principal
from service.states import SweepStatus
from torchyard.contract.errors import NotFoundError


def create_sweep(session: Session, settings: Settings, principal: Principal, body: SweepCreate) -> Sweep:
    """Validate, store the sweep and queue its first trials, in one transaction."""
    spec, normalized = validate(body)
    name = (
        body.name
        or f"sweep-{spec.name or (spec.model.architecture if isinstance(spec, TrainJobCreate) else 'script')}"
    )
    normalized["name"] = name
    now = utcnow()
    sweep = Sweep(
        owner_id=principal.id,
        # Its trials are the team's jobs (their spec's team, else the user's first).
        team_id=team_for_submission(session, principal, spec.team),
        name=name,
        status=SweepStatus.RUNNING.value,
        spec=normalized,
        algorithm=body.algorithm,
        max_trials=body.max_trials,
        max_concurrent_trials=body.max_concurrent_trials,
        trials_created=0,
        created_at=now,
        updated_at=now,
    )
    session.add(sweep)
    session.flush()
    # The first trials are queued now: a job spec that cannot run (a missing dataset, a
    # resource the cluster lacks) fails the request, and nothing is stored.
    create_trials(session, settings, sweep, [])
    session.commit()
    return sweep


def get_sweep(session: Session, principal: Principal, ref: str, *, for_update: bool = False) -> Sweep:
    def by_id(wanted: str) -> Sweep | None:
        stmt = select(Sweep).where(Sweep.id == wanted)
        return session.scalars(stmt.with_for_update() if for_update else stmt).first()

    sweep = by_id(ref) if refs.comparable(ref) else None
    if sweep is None or not owns(principal, sweep.owner_id):
        visible = owned(principal, Sweep.owner_id)
        found = refs.resolve(session, Sweep, visible, ref, "sweep")
        sweep = None if found is None else by_id(found)
        if sweep is None:
            raise NotFoundError(
                f"sweep {ref!r} not found (no sweep you may see has this id, name or id prefix)"
            )
    return sweep


def list_sweeps(
    session: Session,
    principal: Principal,
    *,
    statuses: list[SweepStatus] | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[Sweep], str | None]:
    stmt = select(Sweep).where(*owned(principal, Sweep.owner_id))
    if statuses:
        stmt = stmt.where(Sweep.status.in_([s.value for s in statuses]))
    return refs.page_newest_first(session, Sweep, stmt, limit=limit, cursor=cursor)


def cancel_sweep(session: Session, principal: Principal, ref: str) -> Sweep:
    """Idempotent: no new trial is asked for, and every live trial's job is cancelled."""
    sweep = get_sweep(session, principal, ref, for_update=True)
    if sweep.status != SweepStatus.RUNNING.value:
        return sweep
    stop(session, sweep, SweepStatus.CANCELLED, f"sweep {sweep.name} cancelled by {principal.name}")
    session.commit()
    return sweep
