"""The agent's one retry policy: what is worth trying again, and how long to wait."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from torchyard.contract.errors import TorchyardError

log = logging.getLogger(__name__)

T = TypeVar("T")
_RETRY_STATUS = frozenset({408, 425, 429})
# A monotonic deadline, or what says it each time it is asked (it may come closer: the
# agent started shutting down while a report waited).
Deadline = float | Callable[[], float]


def due(deadline: Deadline | None) -> float | None:
    """The deadline as it stands now."""
    return deadline() if callable(deadline) else deadline


def is_retryable(exc: BaseException) -> bool:
    """Worth trying again: the network, or the API's own trouble (5xx, 429...)."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, TorchyardError):
        return exc.status_code >= 500 or exc.status_code in _RETRY_STATUS
    return False


class Backoff:
    """The agent's one retry policy: exponential backoff with jitter, ``first`` seconds
    doubling up to ``cap``; ``reset()`` after a success."""

    def __init__(self, first: float = 0.2, cap: float = 10.0) -> None:
        self.first = first
        self.cap = cap
        self.current = first

    def next(self) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.current * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.current = self.first


def retrying(
    call: Callable[[], T],
    what: str,
    *,
    stop: threading.Event | None = None,
    deadline: Deadline | None = None,
    cap: float = 10.0,
) -> T:
    """``call()`` until it succeeds, raises something not retryable, ``stop`` is set, or
    ``deadline`` (monotonic, asked again before each wait) passes; the last error is raised then."""
    backoff = Backoff(cap=cap)
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_retryable(exc):
                raise
            delay = backoff.next()
            limit = due(deadline)
            if (stop is not None and stop.is_set()) or (
                limit is not None and time.monotonic() + delay > limit
            ):
                raise
            log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
