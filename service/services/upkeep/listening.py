"""Since when this replica has heard the nodes: silence is judged only after a full lease.

Silence means something only while somebody was listening. Each replica keeps a
:class:`ListeningClock`: the moment since when it has been able to hear the nodes (its
start, and again the end of every database outage it saw). Until a full
``lease_timeout_s`` has passed on that clock, nothing is declared lost: an API that was
down (restarted, upgraded, its database unreachable) for longer than the lease timeout
first gives every node a full lease period to heartbeat again. On PostgreSQL, the clock
is the cluster's (:mod:`service.services.replicas`): every replica writes since when it
has been listening to ``api_replicas`` on each pass, and silence is judged from the latest
of those moments; a replica that vanished (killed, stopped, cut off) and was not replaced
yet by a replica started since keeps every other replica from declaring anything lost,
for at most ``replica_memory_s``: the nodes that talked to it could not be heard.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime

from service.db.types import utcnow
from service.services.replicas import ClusterHearing

log = logging.getLogger(__name__)


class ListeningClock:
    """Since when this replica has been able to hear the nodes without a break."""

    def __init__(self, since: datetime | None = None) -> None:
        self._lock = threading.Lock()
        self._since = since or utcnow()
        self._deaf = False
        # On PostgreSQL, what every replica's row says (see service.services.replicas).
        self._cluster: ClusterHearing | None = None

    @property
    def since(self) -> datetime:
        with self._lock:
            return self._since

    def lost_hearing(self) -> None:
        """The database could not be reached: heartbeats may be going unrecorded."""
        with self._lock:
            self._deaf = True

    def heard(self) -> None:
        """The database answered again: start a fresh grace period if it had not."""
        with self._lock:
            if self._deaf:
                self._deaf = False
                self._since = utcnow()
                log.warning(
                    "the database is reachable again: nodes get a full lease period before being lost"
                )

    def cluster_heard(self, hearing: ClusterHearing) -> None:
        """The cluster of replicas' clock, read on this reaper pass."""
        with self._lock:
            if hearing.deaf and (self._cluster is None or not self._cluster.deaf):
                log.warning(
                    "an API replica was last seen at %s and has not been replaced: "
                    "no node is declared lost until one starts",
                    hearing.vanished,
                )
            self._cluster = hearing

    def grace_left(self, lease_timeout_s: float, now: datetime) -> float:
        """Seconds until silence can be judged (0 once a full lease period was heard, by this
        replica and, on PostgreSQL, by every replica of the cluster)."""
        with self._lock:
            if self._deaf or (self._cluster is not None and self._cluster.deaf):
                return lease_timeout_s
            since = self._since
            if self._cluster is not None:
                since = max(since, self._cluster.since)
            return max(0.0, lease_timeout_s - (now - since).total_seconds())
