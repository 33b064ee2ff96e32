"""What every placement of one agent shares: the API client, the node, its folders."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.agent.api import WorkerApi
from worker.agent.run_files import DEFAULT_LOG_BACKLOG_BYTES


@dataclass
class AgentContext:
    """What every placement of one agent shares."""

    api: WorkerApi
    node_name: str
    work_dir: Path
    cpus: int
    grace_s: float
    socket_ifname: str | None
    lease_timeout_s: float = 15.0
    heartbeat_interval_s: float = 2.0
    # Called with each PlacementRun as it ends (its units go back, old runs are pruned).
    release: Callable[[Any], None] = field(default=lambda run: None)
    # Set when the agent shuts down: waits on an unreachable API are cut short then.
    shutdown: threading.Event = field(default_factory=threading.Event)
    # Set when the agent drains its node to exit (SIGTERM): it is leaving too, and its
    # placements' last reports wait for an unreachable API no longer than at a shutdown.
    draining: threading.Event = field(default_factory=threading.Event)
    log_backlog_bytes: int = DEFAULT_LOG_BACKLOG_BYTES
    # bwrap, off or unavailable (worker.agent.sandbox): how this node confines its runs.
    sandbox: str = "off"
    # The engine signals every process of the run (Slurm): torchrun and the ranks ignore its
    # SIGTERM and SIGUSR1, which reach the launcher as a preemption (LaunchSpec.shielded).
    shielded: bool = False
    # The node's processing units; 0 when the whole of ``cpus`` is this one placement's (a
    # launcher in an allocation of its own).
    node_units: int = 0

    def leaving(self) -> bool:
        """The agent is going away (shut down, or draining after SIGTERM): waits for an
        unreachable API are cut short."""
        return self.shutdown.is_set() or self.draining.is_set()

    def cpus_for(self, units: int) -> int:
        """A placement's share of the node's CPUs, by the units it holds: two 1-unit jobs on a
        2-slot, 2-core node get a core each, not two threads each on the same two cores."""
        if self.node_units <= 0:
            return self.cpus
        return max(1, self.cpus * units // self.node_units)

    @property
    def dataset_cache(self) -> Path:
        return self.work_dir / "datasets"

    @property
    def runs_dir(self) -> Path:
        """The placements' run folders: each one the tree its run's processes may write."""
        return self.work_dir / "runs"

    @property
    def placements_dir(self) -> Path:
        """The agent's own files of each placement (its log, the processes' stdout, the
        metrics and MLflow state it writes, the outputs archive): beside the run folders,
        never inside one, so nothing a run writes reaches them (worker.agent.job_tree)."""
        return self.work_dir / "placements"

    @property
    def models_dir(self) -> Path:
        return self.work_dir / "models"
