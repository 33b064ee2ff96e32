"""How much each search-space key of a sweep mattered to its objective: Optuna's parameter
importances over the sweep's completed trials, on its study rebuilt from the tables as for
a decision (:mod:`service.services.sweep_search`).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import SweepTrial
from service.schemas.sweeps import SweepImportance
from service.services.metric_series import LruCache
from service.services.sweeps import get_sweep
from service.services.tokens import Principal
from service.states import TrialState

# Completed trials an importance needs: one alone says nothing about its parameters.
MIN_TRIALS = 2

Key = tuple[str, tuple[tuple[int, float], ...]]  # the sweep, its completed trials' numbers and values
Found = tuple[dict[str, float] | None, str | None]  # the importances, or why there are none
# Asked again while no trial completed (the sweep's page asks as it refreshes), the
# importances are not computed again.
_found: LruCache[Key, Found] = LruCache(200)


def importance(session: Session, principal: Principal, ref: str) -> SweepImportance:
    """The sweep's search-space keys by importance for its objective, largest first."""
    sweep = get_sweep(session, principal, ref)
    trials = list(
        session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep.id).order_by(SweepTrial.number))
    )
    completed = [t for t in trials if t.state == TrialState.COMPLETED.value and t.value is not None]
    answer = SweepImportance(sweep_id=sweep.id, objective=sweep.spec["objective"], completed=len(completed))
    if len(completed) < MIN_TRIALS:
        answer.message = f"{MIN_TRIALS} completed trials are needed ({len(completed)} so far)"
        return answer
    key = (sweep.id, tuple((t.number, float(t.value or 0.0)) for t in completed))
    found = _found.get(key)
    if found is None:
        # Optuna (and what its importances import) is loaded only when first asked.
        from service.services.sweep_search import importances, rebuild

        found = importances(rebuild(sweep, trials, len(trials)).study)
        _found.put(key, found)
    answer.importances, answer.message = found
    return answer
