"""The replica's scheduling loop: passes run out of the request path, one at a time.

Whatever may let a queued job start — a submission, a placement that ended, a node that
registered, came back, was drained or undrained, the reaper's periodic look — calls
:meth:`SchedulerLoop.request` after its commit and returns. One thread runs the passes:
a pass starts after the request that asked for it and covers every request made before
it started, so a burst of submissions (or of claims) costs one or two passes, however
many nodes are waiting. Passes start at least :data:`PASS_GAP_S` apart: a request after a
quiet spell is passed for at once, and a steady stream of them (submissions one after the
other, jobs ending all over a large cluster) costs a few passes a second, not one per
request; each pass reads the queue's head and every ready node. A pass that placed work
wakes the claims parked for those nodes (:class:`~service.services.wakeup.Wakeup`); on
PostgreSQL the pass also announces them to the other replicas (``NOTIFY``, see
:mod:`service.services.wakeup`).

Several replicas each run their own loop; their passes serialise on the scheduler's
advisory lock (see :mod:`service.services.scheduler`), and each replica passes only for
the changes it took in itself, so passes grow with replicas, never with nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from typing import Protocol

from service.config import Settings
from service.db.engine import Database, is_unavailable
from service.services import metrics
from service.services.node_timing import NodeTiming
from service.services.scheduler import PassResult
from service.services.wakeup import Wakeup

log = logging.getLogger(__name__)

# After a failed pass (the database unreachable), the next one waits this long.
_RETRY_S = 0.5
# Passes start at least this long apart (a pass at 1,000 nodes and a long queue takes 5-15 ms
# of a core; back to back under a stream of submissions they took a fifth of the API's CPU).
PASS_GAP_S = 0.2


class Passes(Protocol):
    """What the loop runs: an engine's passes (the reconciler, service.services.reconciler)."""

    @property
    def period_s(self) -> float | None:
        """Seconds between passes even when nothing asked for one (None: only when asked)."""

    def run_pass(self, db: Database, settings: Settings) -> PassResult:
        """One pass, committed."""
        ...


class SchedulerLoop:
    """Coalesced scheduling passes in a thread of their own (see the module's docstring)."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        wakeup: Wakeup,
        engine: Passes,
        timing: NodeTiming | None = None,
        gap_s: float = PASS_GAP_S,
    ) -> None:
        self._db = db
        self._gap_s = gap_s
        # What a pass runs: the engine's reconciler (service.services.reconciler) — the gang
        # scheduler of the built-in agents, or an engine that schedules, which also runs every
        # ``engine.period_s`` unasked (it polls).
        self._engine = engine
        self._settings = settings
        # The lease a placement starts with follows the cluster's size (see node_timing).
        self._timing = timing
        self._wakeup = wakeup
        self._cond = threading.Condition()
        self._requested = 0  # tickets handed out
        self._done = 0  # every ticket up to this one is covered by a finished pass
        self._stopping = False
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        # Passes run so far (what the tests and the benchmark count).
        self.passes = 0

    def start(self) -> SchedulerLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._release(self._requested)

    def request(self) -> int:
        """Ask for a pass after the caller's commit (any thread); returns its ticket."""
        with self._cond:
            self._requested += 1
            self._cond.notify_all()
            return self._requested

    def pending(self) -> int | None:
        """The ticket a pass still has to cover, or None when every request is covered."""
        with self._cond:
            return self._requested if self._requested > self._done else None

    async def settled(self, ticket: int, timeout: float) -> bool:
        """Wait until a pass covering ``ticket`` has finished (or ``timeout``); True if it did."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (ticket, loop, future)
        with self._cond:
            if self._done >= ticket or self._stopping:
                return True
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(future, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._cond, contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def _run(self) -> None:
        last_start = -math.inf
        while True:
            with self._cond:
                period = self._engine.period_s
                while self._requested <= self._done and not self._stopping:
                    if not self._cond.wait(period) and period is not None:
                        break  # an engine that polls: a pass is due anyway
                # Not sooner than the gap after the last pass started: the requests made
                # meanwhile are covered by the one pass that follows.
                while not self._stopping and (wait := last_start + self._gap_s - time.monotonic()) > 0:
                    self._cond.wait(wait)
                if self._stopping:
                    return
                target = self._requested
            last_start = time.monotonic()
            try:
                settings = self._timing.settings() if self._timing is not None else self._settings
                with metrics.SCHEDULING_PASS.time():
                    result = self._engine.run_pass(self._db, settings)
            except Exception as exc:
                metrics.SCHEDULING_PASS_FAILURES.inc()
                if is_unavailable(exc):
                    log.warning("scheduling pass failed: the database is unreachable; retrying")
                else:
                    log.exception("scheduling pass failed")
                with self._cond:
                    self._cond.wait(_RETRY_S)
                continue
            self.passes += 1
            if result.placed_nodes:
                self._wakeup.notify(result.placed_nodes)
            self._release(target)

    def _release(self, target: int) -> None:
        with self._cond:
            self._done = max(self._done, target)
            ready = [w for w in self._waiters if w[0] <= self._done or self._stopping]
        for _ticket, loop, future in ready:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
