"""Wake long-polling claims as soon as this process has placed or queued work.

A claim waits on an event loop; submissions, status reports and the reaper run in
worker threads. :meth:`Wakeup.notify` may be called from any thread. Waiters compare
a generation number, so a notification that lands between a waiter's database check
and its wait is never lost. Work placed by another API replica is found by the
claim's periodic database re-check instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class Wakeup:
    """A broadcast, thread-safe, level-triggered wake-up for asyncio waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    @property
    def generation(self) -> int:
        """Read before checking for work; pass to :meth:`wait`."""
        with self._lock:
            return self._generation

    def notify(self) -> None:
        """Wake every waiter (callable from any thread)."""
        with self._lock:
            self._generation += 1
            waiters = list(self._waiters)
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # the waiter's loop is closed
                loop.call_soon_threadsafe(_resolve, future)

    async def wait(self, since: int, timeout: float) -> bool:
        """Wait until notified after generation ``since`` or until ``timeout``; True if notified."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            if self._generation != since:
                return True
            self._waiters.add(entry)
        try:
            await asyncio.wait_for(future, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                self._waiters.discard(entry)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
