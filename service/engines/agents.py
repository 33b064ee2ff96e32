"""The built-in engine: torchyard's resident worker agents.

Inventory: agents register their node and heartbeat it (``nodes_heartbeat``). Submit: the
service's gang scheduler writes an attempt's placements onto ready nodes
(:mod:`service.services.scheduler`) and each node's agent claims its own — the engine does
not schedule. Poll: the agents' heartbeats and reports, and the upkeep pass (leases, lost
nodes). Cancel: stop orders in the heartbeat answers. So the port's operations are never
called for this engine: its capabilities send the reconciler to the gang scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.engines.base import Capabilities, EngineJobState, LaunchRequest, NodeSeen
from service.states import EngineName


class AgentsDriver:
    name = EngineName.AGENTS
    display_name = "torchyard's agents"
    launcher = "torchyard worker"
    cancel_verb = "stopped"
    capabilities = Capabilities(schedules=False, nodes_heartbeat=True, reports_ends=False)

    @property
    def period_s(self) -> float | None:
        return None

    def start(self) -> None:
        return None

    def inventory(self) -> list[NodeSeen]:
        return []  # the agents register their nodes themselves

    def submit(self, request: LaunchRequest) -> str:
        raise NotImplementedError("the agents claim the placements the gang scheduler writes")

    def poll(self, ids: Sequence[str]) -> dict[str, EngineJobState]:
        return {}  # the agents report their placements themselves

    def cancel(self, engine_job_id: str) -> None:
        return None  # stop orders go out in the heartbeat answers
