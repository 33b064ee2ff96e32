"""The built-in engine: torchyard's resident worker agents.

Inventory: agents register their node and heartbeat it. Submit: the gang scheduler writes
an attempt's placements onto ready nodes (:mod:`service.services.scheduler`), and each
node's agent claims its own. Poll: heartbeats and the reaper (leases, lost nodes). Cancel:
stop orders in the heartbeat answers.
"""

from __future__ import annotations

from service.config import Settings
from service.db.engine import Database
from service.services.scheduler import PassResult, run_pass
from service.states import ENGINE_AGENTS


class AgentsEngine:
    name = ENGINE_AGENTS

    @property
    def period_s(self) -> float | None:
        return None

    def start(self) -> None:
        return None

    def run_pass(self, db: Database, settings: Settings) -> PassResult:
        return run_pass(db, settings)
