"""Wake long-polling claims when work is placed on their node.

A claim waits on an event loop, keyed by its node's id; scheduling passes run in other
threads. :meth:`Wakeup.notify` may be called from any thread, for some nodes (the ones a
pass placed work on) or for every waiter. Waiters compare a generation number, so a
notification that lands between a waiter's database check and its wait is never lost.

Across API replicas (PostgreSQL), a pass that places work sends ``NOTIFY`` on
:data:`PLACED_CHANNEL` with the node ids, in its own transaction; every replica's
:class:`PlacementListener` ``LISTEN``\\ s and wakes the claims parked on it for those nodes.
While the listener is not connected (the database restarting), notifications may be
missed: :attr:`Wakeup.reliable` is False and parked claims re-read their node's placements
every ``claim_recheck_interval_s``; once it is back, every parked claim checks once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

# The PostgreSQL channel on which passes announce the nodes they placed work on.
PLACED_CHANNEL = "torchyard_placed"
# NOTIFY payloads are limited to 8,000 bytes: node ids (32 characters) go in chunks.
_IDS_PER_NOTIFY = 200


class Wakeup:
    """A thread-safe, level-triggered wake-up for asyncio waiters, per key or for all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all = 0
        self._by_key: dict[str, int] = {}
        self._notified = 0  # every notify() of any key: see stamp()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        # Whether every placement reaches notify() (see the module's docstring).
        self.reliable = True

    def generation(self, key: str) -> tuple[int, int]:
        """Read before checking for work; pass to :meth:`wait`."""
        with self._lock:
            return self._all, self._by_key.get(key, 0)

    def stamp(self) -> int:
        """How many notifications there were, of any key: read before a first look for work
        whose key is not known yet; if :meth:`stamp` is unchanged when the key's
        :meth:`generation` is read after the look, no notification fell in between."""
        with self._lock:
            return self._notified

    def notify(self, keys: Iterable[str] | None = None) -> None:
        """Wake the waiters of ``keys``, or every waiter when None (callable from any thread)."""
        with self._lock:
            self._notified += 1
            if keys is None:
                self._all += 1
                waiters = [w for group in self._waiters.values() for w in group]
            else:
                waiters = []
                for key in set(keys):
                    self._by_key[key] = self._by_key.get(key, 0) + 1
                    waiters.extend(self._waiters.get(key, ()))
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # the waiter's loop is closed
                loop.call_soon_threadsafe(_resolve, future)

    async def wait(self, key: str, since: tuple[int, int], timeout: float) -> bool:
        """Wait until ``key`` (or everyone) is notified after generation ``since``, or until
        ``timeout``; True if notified."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            if (self._all, self._by_key.get(key, 0)) != since:
                return True
            self._waiters.setdefault(key, set()).add(entry)
        try:
            await asyncio.wait_for(future, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                group = self._waiters.get(key)
                if group is not None:
                    group.discard(entry)
                    if not group:
                        del self._waiters[key]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def announce_placed(session: Session, node_ids: Iterable[str]) -> None:
    """PostgreSQL: tell every replica, when ``session`` commits, that work was placed on these
    nodes (nothing on SQLite, which serves one replica)."""
    ids = sorted(set(node_ids))
    if not ids or session.get_bind().dialect.name != "postgresql":
        return
    for start in range(0, len(ids), _IDS_PER_NOTIFY):
        payload = ",".join(ids[start : start + _IDS_PER_NOTIFY])
        session.execute(
            text("SELECT pg_notify(:channel, :payload)"), {"channel": PLACED_CHANNEL, "payload": payload}
        )


class PlacementListener:
    """PostgreSQL: a thread that ``LISTEN``\\ s on :data:`PLACED_CHANNEL` and wakes this replica's
    claims parked for the nodes named; it reconnects after losing the database."""

    def __init__(self, url: str, wakeup: Wakeup, connect_args: dict[str, Any]) -> None:
        self._conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self._connect_args = {k: v for k, v in connect_args.items() if k != "options"}
        self._wakeup = wakeup
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="placement-listener", daemon=True)
        self.connected = threading.Event()

    def start(self) -> None:
        self._wakeup.reliable = False  # until LISTEN is in place
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import psycopg

        delay = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True, **self._connect_args) as conn:
                    conn.execute(f"LISTEN {PLACED_CHANNEL}")
                    self._wakeup.reliable = True
                    self.connected.set()
                    # Anything placed while not listening: every parked claim checks once.
                    self._wakeup.notify()
                    delay = 0.5
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self._wakeup.notify(note.payload.split(","))
            except Exception as exc:  # the database went away: claims re-check until back
                self._wakeup.reliable = False
                self.connected.clear()
                if self._stop.is_set():
                    return
                log.warning("placement notifications lost (%s); reconnecting in %.1f s", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
