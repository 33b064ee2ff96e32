"""The reaper: the background loop of one API replica, running an upkeep pass
(:func:`service.services.upkeep.upkeep_pass.run_upkeep_pass`) every ``reaper_interval_s``,
across database outages (each one restarts the replica's listening clock)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from starlette.concurrency import run_in_threadpool

from service.config import Settings
from service.db.engine import Database, is_unavailable
from service.services.node_timing import NodeTiming
from service.services.replicas import ReplicaRow
from service.services.scheduler import has_queued_jobs
from service.services.scheduler_loop import SchedulerLoop
from service.services.upkeep.listening import ListeningClock
from service.services.upkeep.upkeep_pass import run_upkeep_pass
from service.services.wakeup import Wakeup

log = logging.getLogger(__name__)


async def run_reaper(
    db: Database,
    settings: Settings,
    wakeup: Wakeup,
    stop: asyncio.Event,
    listening: ListeningClock | None = None,
    scheduling: SchedulerLoop | None = None,
    timing: NodeTiming | None = None,
) -> None:
    """The background loop of one API replica, until ``stop`` is set. With ``scheduling``,
    its scheduling passes are asked of that loop (shared with every other request). With
    ``timing``, it counts the nodes now and then and judges silence by the lease of the
    moment (:mod:`service.services.node_timing`)."""
    listening = listening or ListeningClock()
    # SQLite serves one replica: its own clock is the cluster's.
    replica = None if db.is_sqlite else ReplicaRow()
    while not stop.is_set():
        try:
            await run_in_threadpool(db.ping)
            listening.heard()
            if timing is not None:
                if timing.due():
                    await run_in_threadpool(timing.refresh, db)
                settings = timing.settings()
            await _one_round(db, settings, wakeup, listening, replica, scheduling)
        except Exception as exc:  # keep the loop alive across database outages
            if is_unavailable(exc):
                listening.lost_hearing()
                log.warning("reaper pass skipped: the database is unreachable (%s)", _first_line(exc))
            else:
                log.exception("reaper pass failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), settings.reaper_interval_s)


async def _one_round(
    db: Database,
    settings: Settings,
    wakeup: Wakeup,
    listening: ListeningClock,
    replica: ReplicaRow | None,
    scheduling: SchedulerLoop | None,
) -> None:
    """One pass, the database heard: the cluster's clock read (PostgreSQL), the upkeep done,
    the nodes given work woken, and a scheduling pass asked for while jobs wait."""
    if replica is not None:
        hearing = await run_in_threadpool(replica.beat, db, settings, listening.since)
        listening.cluster_heard(hearing)
    result = await run_in_threadpool(
        functools.partial(run_upkeep_pass, db, settings, listening, schedule=scheduling is None)
    )
    if result.placed_nodes:
        wakeup.notify(result.placed_nodes)
    if scheduling is not None and await run_in_threadpool(has_queued_jobs, db):
        scheduling.request()


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
