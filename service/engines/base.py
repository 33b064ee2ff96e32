"""The engine interface: inventory, submit, poll, cancel (see :mod:`service.engines`)."""

from __future__ import annotations

from typing import Protocol

from service.config import Settings
from service.db.engine import Database
from service.services.scheduler import PassResult


class Engine(Protocol):
    """What runs attempts. One pass (:meth:`run_pass`) does all of an engine's work in turn:
    its inventory, handing queued jobs to it (submit), reading back how its jobs are doing
    (poll) and stopping those whose attempt ended (cancel). Passes run one at a time in the
    replica's scheduling loop (:mod:`service.services.scheduler_loop`), when something may let
    a job start and, for an engine that polls, every :attr:`period_s` seconds."""

    name: str

    @property
    def period_s(self) -> float | None:
        """Seconds between passes even when nothing asked for one (None: only when asked)."""

    def start(self) -> None:
        """Check the engine can be used (raise :class:`EngineUnavailable` with one clear line)."""

    def run_pass(self, db: Database, settings: Settings) -> PassResult:
        """One pass, committed."""
        ...


class EngineUnavailable(RuntimeError):
    """The engine cannot be used as configured (a missing command, an unknown partition)."""
