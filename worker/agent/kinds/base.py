"""What every job kind answers on the agent side (one module per kind beside this one).

A kind prepares a placement's inputs, launches its processes and decides the outcome
once they ended; :class:`worker.agent.placement.PlacementRun` does the rest for every
kind (the run folder and log, reports, heartbeats' stop orders, the watch loop, the final
status). A kind sees its placement through :class:`PlacementHost`.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Protocol

from torchyard.contract.failures import FailureReport
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ClaimedPlacement
from worker.agent.checkpoints import CheckpointUploader
from worker.agent.context import AgentContext
from worker.agent.lease import LeaseSession
from worker.agent.rank_group import RankGroup
from worker.agent.reporting import RunReporter
from worker.agent.run_outcome import OutcomeReport, StopKind
from worker.agent.script_run import ScriptGroup
from worker.agent.watchdog import HangWatchdog


class PlacementHost(Protocol):
    """What a kind uses of the placement it runs."""

    ctx: AgentContext
    session: LeaseSession
    report: OutcomeReport
    job_id: str
    node_rank: int
    units: int
    gpu_ids: tuple[int, ...]
    run_dir: Path  # the tree the run's processes write (read through worker.agent.job_tree)
    agent_dir: Path  # the agent's own files of the placement, out of the run's reach
    log: logging.Logger
    stop_event: threading.Event
    stop_kind: StopKind | None
    preempt_event: threading.Event
    group: RankGroup | ScriptGroup | None
    uploader: CheckpointUploader | None
    watchdog: HangWatchdog | None
    hang: FailureReport | None

    @property
    def work(self) -> ClaimedPlacement: ...

    def start_reporter(
        self,
        log_sources: Callable[[], list[tuple[str, Path]]],
        agent_log: Path,
        metric_sources: Callable[[], list[Path]] | None = None,
        *,
        tracking_source: Callable[[], bytes | None] | None = None,
    ) -> RunReporter | None: ...


class KindRun(ABC):
    """One placement of a kind: made when the placement's thread starts."""

    kind: ClassVar[JobKind]
    # Claimed while the node drains (before anything started): handed back as ``preempted``.
    hands_back_when_draining: ClassVar[bool] = False

    def __init__(self, host: PlacementHost) -> None:
        self.host = host

    @abstractmethod
    def describe(self) -> None:
        """Log what runs where."""

    @abstractmethod
    def prepare(self) -> None:
        """Fetch the inputs and write what the processes read; raises when it cannot."""

    @abstractmethod
    def launch(self, agent_log: Path) -> tuple[RankGroup | ScriptGroup, RunReporter | None]:
        """Start the processes (``host.group``) and what ships their metrics and logs."""

    def close(self) -> None:  # noqa: B027 (most kinds have nothing to close)
        """After the processes ended (or were stopped), whatever happened."""

    @abstractmethod
    def outcome(self, exit_code: int | None, agent_log: Path) -> tuple[str, FailureReport | None]:
        """``stopped``, ``preempted``, ``succeeded`` or ``failed`` (with the failure), once
        the processes ended; what the kind keeps is uploaded here."""
