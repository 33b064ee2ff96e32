"""Engines (docs/engines.md): what runs the attempts the service schedules.

An engine is a driver behind one port (:mod:`service.engines.base`): what nodes the
cluster has (inventory), how an attempt starts (submit), how it is doing (poll) and how it
stops (cancel), typed in and out. Drivers know nothing of the database: one reconciler in
the service layer (:mod:`service.services.reconciler`) makes their answers into node,
attempt and job rows, the same way for every engine, so that ``GET /v1/cluster``, the
limits, restarts, preemption and cancel work unchanged whatever runs the jobs. The job
model, leases, reports, checkpoints and models are the same whatever the engine: a
placement is run by torchyard's own code on the node, by a resident agent or by a
one-placement launcher. What sets engines apart is declared (:class:`Capabilities`).

* ``agents`` (the default): torchyard's worker agents register their nodes and claim the
  placements the gang scheduler writes (:mod:`service.services.scheduler`).
* ``slurm``: an existing Slurm cluster (:mod:`service.engines.slurm`): one ``sbatch`` per
  attempt, one launcher per node by ``srun``.
* ``kubernetes``: a Kubernetes cluster (:mod:`service.engines.kubernetes`): one pod per node
  rank of each attempt, owned by one Service, all or nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from service.config import Settings
from service.engines.agents import AgentsDriver
from service.engines.base import KUBERNETES_CAPABILITIES, Capabilities, Driver
from service.engines.slurm import SLURM_CAPABILITIES, SlurmDriver
from service.states import EngineName

# What each engine is, by the name kept on nodes and attempts (drivers are made only for the
# engine a replica runs: make_driver).
CAPABILITIES: dict[str, Capabilities] = {
    EngineName.AGENTS: AgentsDriver.capabilities,
    EngineName.SLURM: SLURM_CAPABILITIES,
    EngineName.KUBERNETES: KUBERNETES_CAPABILITIES,
}


def capabilities_of(engine: str) -> Capabilities:
    """The capabilities of the engine a node or an attempt belongs to."""
    return CAPABILITIES[engine]


def make_driver(settings: Settings) -> Driver:
    """The driver of the engine ``TORCHYARD_ENGINE`` names."""
    drivers: dict[str, Callable[[Settings], Driver]] = {
        EngineName.AGENTS: lambda _settings: AgentsDriver(),
        EngineName.SLURM: SlurmDriver,
        EngineName.KUBERNETES: _kubernetes,
    }
    return drivers[settings.engine](settings)


def _kubernetes(settings: Settings) -> Driver:
    from service.engines.kubernetes import KubernetesDriver

    return KubernetesDriver(settings)


__all__ = ["CAPABILITIES", "AgentsDriver", "Capabilities", "Driver", "capabilities_of", "make_driver"]
