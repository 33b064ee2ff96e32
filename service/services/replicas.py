"""The cluster's listening clock: since when every API replica on one PostgreSQL has been
able to hear the nodes.

Heartbeats land in the shared database whichever replica hears them, but an agent talks
to one API address: while the replica behind it is down, its nodes cannot be heard by
anyone, and the other replicas must not take that silence for a dead node. So every
replica writes a row to ``api_replicas`` on each reaper pass (its start, since when it
has been listening, and now), and reads all of them back:

- the cluster has been listening since the **latest** ``listening_since`` of the replicas
  seen recently (this one included): a replica that just started, or just saw the
  database again, gives every node a full lease period before anything is lost;
- a replica that **vanished** (not seen for ``stale_after_s``: killed, stopped, cut off
  from the database) makes the cluster deaf: nothing is lost until a replica starts after
  it vanished (presumably its restart; that start then gives every node a full lease), or
  until ``replica_memory_s`` has passed since it was last seen.

The price: a node that really died is declared lost up to one lease period later after
any replica restart, and not at all while a vanished replica is neither replaced nor
forgotten. SQLite serves one replica only; its own clock is the cluster's, and no row is
written (each would take SQLite's single write lock every reaper pass for nothing).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert

from service.config import Settings
from service.db.engine import Database
from service.db.models import ApiReplica
from service.db.types import new_id, utcnow


def stale_after_s(settings: Settings) -> float:
    """A replica not seen for this long has vanished: a few reaper passes, and at most half a
    lease, so that it counts as vanished before a node it was hearing has been silent for a
    whole lease period (a heartbeat interval plus this is below the lease timeout)."""
    return min(settings.lease_timeout_s / 2, max(3 * settings.reaper_interval_s, 2.0))


@dataclass(frozen=True)
class ClusterHearing:
    """What the replicas' rows say: listening since ``since``, or ``deaf`` because of
    ``vanished`` (a replica last seen at that moment, not replaced since)."""

    since: datetime
    vanished: datetime | None = None

    @property
    def deaf(self) -> bool:
        return self.vanished is not None


def cluster_hearing(
    rows: list[tuple[datetime, datetime, datetime]], settings: Settings, now: datetime
) -> ClusterHearing:
    """The rule, from every replica's ``(started_at, listening_since, seen_at)`` (this one's
    included). A vanished replica is replaced only by a replica *started* after it was last
    seen (presumably its restart), not by one that merely saw the database again."""
    stale = now - timedelta(seconds=stale_after_s(settings))
    forgotten = now - timedelta(seconds=settings.replica_memory_s)
    alive = [(started, since) for started, since, seen in rows if seen >= stale]
    since = max((since for _started, since in alive), default=now)
    newest_start = max((started for started, _since in alive), default=now)
    vanished = [seen for _started, _since, seen in rows if forgotten <= seen < stale and seen >= newest_start]
    return ClusterHearing(since, max(vanished) if vanished else None)


class ReplicaRow:
    """This replica's row in ``api_replicas``."""

    def __init__(self) -> None:
        self.id = new_id()
        self.host = socket.gethostname()[:255]
        self.pid = os.getpid()
        self.started_at = utcnow()

    def beat(self, db: Database, settings: Settings, listening_since: datetime) -> ClusterHearing:
        """Write this replica's row, forget replicas gone for longer than ``replica_memory_s``,
        and read what the cluster has heard (one transaction)."""
        now = utcnow()
        values = {
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "started_at": self.started_at,
            "listening_since": listening_since,
            "seen_at": now,
        }
        keep = max(settings.replica_memory_s, stale_after_s(settings))
        with db.transaction() as session:
            stmt = insert(ApiReplica).values(**values)
            session.execute(
                stmt.on_conflict_do_update(
                    index_elements=[ApiReplica.id],
                    set_={"listening_since": listening_since, "seen_at": now},
                )
            )
            session.execute(delete(ApiReplica).where(ApiReplica.seen_at < now - timedelta(seconds=keep)))
            rows = [
                (started, since, seen)
                for started, since, seen in session.execute(
                    select(ApiReplica.started_at, ApiReplica.listening_since, ApiReplica.seen_at)
                )
            ]
        return cluster_hearing(rows, settings, now)
