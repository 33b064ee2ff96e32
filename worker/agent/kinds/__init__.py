"""Job kinds on the agent side: one module per kind (:mod:`.train`, :mod:`.script`,
:mod:`.evaluate`), each a :class:`~worker.agent.kinds.base.KindRun`.

A new kind adds its module and one line in :data:`RUNS`.
"""

from __future__ import annotations

from torchyard.contract.jobspec import JobKind
from worker.agent.kinds.base import KindRun, PlacementHost
from worker.agent.kinds.evaluate import EvaluateRun
from worker.agent.kinds.script import ScriptRun
from worker.agent.kinds.train import TrainRun

RUNS: dict[JobKind, type[KindRun]] = {run.kind: run for run in (TrainRun, ScriptRun, EvaluateRun)}


def run_for(host: PlacementHost) -> KindRun:
    """The kind's run of the placement ``host`` runs."""
    run = RUNS.get(host.work.type)
    if run is None:
        raise RuntimeError(f"this agent cannot run jobs of type {host.work.type!r}")
    return run(host)


__all__ = ["RUNS", "KindRun", "PlacementHost", "run_for"]
