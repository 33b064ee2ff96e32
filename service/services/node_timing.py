"""How often nodes heartbeat and how long their leases last, growing with the cluster.

Every node heartbeats every ``heartbeat_interval_s``: with a fixed interval the API's load
grows with the node count (1,000 nodes every 2 s are 500 requests a second, more than one
API process answers on a small machine). Unless ``TORCHYARD_HEARTBEAT_INTERVAL_S`` or
``TORCHYARD_LEASE_TIMEOUT_S`` is set explicitly (then both are used as set), the interval
handed to the nodes grows with the number of registered nodes so that all of them together
send about ``heartbeats_per_s`` heartbeats a second, between the configured interval (the
shortest) and :data:`MAX_INTERVAL_S`; the lease timeout is at least
:data:`LEASE_PER_INTERVAL` intervals (as Kubernetes node leases: renewed every 10 s,
expired after 40 s). 1,000 nodes at the default 100 a second heartbeat every 10 s with a
40 s lease; up to 200 nodes keep the defaults (2 s, 15 s).

A claim long-poll is held up to ``claim_poll_timeout_s``; unless that is set explicitly it
grows with the interval too, to :data:`CLAIM_WAIT_PER_INTERVAL` intervals (at most
:data:`MAX_CLAIM_WAIT_S`): an idle node's claim costs about what a heartbeat costs, so 1,000
nodes re-claiming every 20 s would cost more than their heartbeats every 10 s.

The nodes read these values at registration and from every heartbeat answer, so a node
registered while the cluster was small slows down at its next heartbeat. When the cluster
shrinks, the interval handed out shrinks at once, but silence is judged against the longer
lease for another two of those leases: every node has been told the shorter interval by
then. Each API replica counts the nodes itself (the same table), about every
:data:`REFRESH_S` seconds and at each registration.
"""

from __future__ import annotations

import math
import threading
import time

from sqlalchemy import func, select

from service.config import Settings
from service.db.engine import Database
from service.db.models import Node
from service.states import NodeStatus

# The longest interval handed out, however many nodes.
MAX_INTERVAL_S = 30.0
# A lease lasts at least this many heartbeat intervals.
LEASE_PER_INTERVAL = 4.0
# How often a replica counts the nodes again (besides at registrations).
REFRESH_S = 10.0
# The claim long-poll, unless set: this many heartbeat intervals, at most MAX_CLAIM_WAIT_S (below
# the 60 s idle timeout common to proxies and load balancers).
CLAIM_WAIT_PER_INTERVAL = 5.0
MAX_CLAIM_WAIT_S = 55.0


def is_explicit(settings: Settings) -> bool:
    """Whether the operator set the timing (environment or arguments): it is used as set."""
    return bool({"heartbeat_interval_s", "lease_timeout_s"} & settings.model_fields_set)


def timing_for(settings: Settings, nodes: int) -> tuple[float, float]:
    """(heartbeat interval, lease timeout) for ``nodes`` registered nodes."""
    base_interval, base_lease = settings.heartbeat_interval_s, settings.lease_timeout_s
    if is_explicit(settings) or nodes <= 0:
        return base_interval, base_lease
    wanted = nodes / settings.heartbeats_per_s
    interval = min(max(base_interval, wanted), max(base_interval, MAX_INTERVAL_S))
    # Whole seconds above the configured interval: the answers stay readable and stable.
    if interval > base_interval:
        interval = float(math.ceil(interval))
    return interval, max(base_lease, LEASE_PER_INTERVAL * interval)


def claim_wait_for(settings: Settings, interval: float) -> float:
    """The longest claim long-poll while nodes heartbeat every ``interval`` seconds."""
    if "claim_poll_timeout_s" in settings.model_fields_set:
        return settings.claim_poll_timeout_s
    grown = min(CLAIM_WAIT_PER_INTERVAL * interval, MAX_CLAIM_WAIT_S)
    return max(settings.claim_poll_timeout_s, grown)


def count_nodes(db: Database, engine: str) -> int:
    """Nodes that heartbeat (registered and not lost), of this engine."""
    with db.read_session() as session:
        return int(
            session.scalar(
                select(func.count(Node.id)).where(Node.engine == engine, Node.status != NodeStatus.LOST)
            )
            or 0
        )


class NodeTiming:
    """The replica's current timing: what it hands to nodes and judges their silence by."""

    def __init__(self, settings: Settings, clock: object = time.monotonic) -> None:
        self._base = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._settings = settings
        self._refreshed = -math.inf
        # The lease silence is judged by, and (while the cluster shrank) until when it is held.
        self._judged = settings.lease_timeout_s
        self._hold_until: float | None = None

    @property
    def explicit(self) -> bool:
        return is_explicit(self._base)

    def settings(self) -> Settings:
        """The settings with the current heartbeat interval and lease timeout."""
        with self._lock:
            return self._settings

    def due(self) -> bool:
        """Whether the node count should be read again."""
        with self._lock:
            return not self.explicit and self._now() - self._refreshed >= REFRESH_S

    def refresh(self, db: Database) -> Settings:
        """Count the nodes and update the timing (any thread); returns the new settings."""
        if self.explicit:
            return self._base
        return self.update(count_nodes(db, self._base.engine))

    def update(self, nodes: int) -> Settings:
        """The timing for ``nodes`` registered nodes (see the module's docstring)."""
        interval, lease = timing_for(self._base, nodes)
        with self._lock:
            now = self._now()
            self._refreshed = now
            if lease >= self._judged:
                self._judged, self._hold_until = lease, None
            elif self._hold_until is None:
                self._hold_until = now + 2 * self._judged
            elif now >= self._hold_until:
                self._judged, self._hold_until = lease, None
            current = self._settings
            claim_wait = claim_wait_for(self._base, interval)
            now_set = (current.heartbeat_interval_s, current.lease_timeout_s, current.claim_poll_timeout_s)
            if now_set != (interval, self._judged, claim_wait):
                self._settings = self._base.model_copy(
                    update={
                        "heartbeat_interval_s": interval,
                        "lease_timeout_s": self._judged,
                        "claim_poll_timeout_s": claim_wait,
                    }
                )
            return self._settings

    def _now(self) -> float:
        return float(self._clock())  # type: ignore[operator]
