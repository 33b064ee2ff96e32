"""Engines (docs/slurm.md): what runs the attempts the service schedules.

An engine answers four questions behind one interface (:class:`~service.engines.base.Engine`):
what nodes the cluster has (inventory, mirrored into the node rows so that ``GET
/v1/cluster``, the limits and ``TORCHYARD_NODE_MEMORY_S`` work unchanged), how an attempt
starts (submit), how it is doing (poll) and how it stops (cancel). The job model, leases,
reports, checkpoints and models are the same whatever the engine: a placement is run by
torchyard's own code on the node, by a resident agent or by a one-placement launcher.

* ``agents`` (the default): torchyard's worker agents register their nodes and claim the
  placements the gang scheduler writes (:mod:`service.services.scheduler`).
* ``slurm``: an existing Slurm cluster (:mod:`service.engines.slurm`): one ``sbatch`` per
  attempt, one launcher per node by ``srun``.
"""

from __future__ import annotations

from service.config import Settings
from service.engines.agents import AgentsEngine
from service.engines.base import Engine


def make_engine(settings: Settings) -> Engine:
    """The engine ``TORCHYARD_ENGINE`` names."""
    if settings.engine == "slurm":
        from service.engines.slurm import SlurmEngine

        return SlurmEngine(settings)
    return AgentsEngine()


__all__ = ["AgentsEngine", "Engine", "make_engine"]
