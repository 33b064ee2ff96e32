"""The gauges a scrape reads from the database (docs/operations.md, "Prometheus and Grafana"):
jobs by state and team, sweep trials by state, nodes by engine and state, units used and free
by pool, the ready nodes' heartbeat lag; and the replica's database pools.

A scrape runs three aggregate queries (jobs, trials, nodes), and their answer is kept for
:data:`CACHE_S`: frequent scrapes, or several Prometheus servers, cost the database little.
The database's gauges are the same whichever replica answers; the pools are this replica's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime

from prometheus_client.metrics_core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.pool import QueuePool

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, Node, Placement, SweepTrial, Team
from service.db.types import utcnow
from service.services.cluster import node_status
from service.services.metrics import DEFAULT_POOL, job_team_label, node_pool
from service.states import JobStatus, NodeStatus, PlacementStatus, TrialState

log = logging.getLogger(__name__)

# Seconds a scrape's database answer is reused.
CACHE_S = 5.0
# Seconds since a ready node's last heartbeat (the agents heartbeat every few seconds; an
# engine's inventory, every poll).
HEARTBEAT_LAG_BUCKETS = (1, 2.5, 5, 10, 15, 30, 60, 120, 300)

_HELD = (
    select(Placement.node_id, func.sum(Placement.units).label("units"))
    .where(Placement.status != PlacementStatus.DONE)
    .group_by(Placement.node_id)
    .subquery()
)
_NODES = select(Node, _HELD.c.units).outerjoin(_HELD, _HELD.c.node_id == Node.id)
# Every job the service still holds (a deleted job's row stays as a tombstone).
_JOBS = (
    select(Job.status, Team.name, func.count(Job.id))
    .outerjoin(Team, Team.id == Job.team_id)
    .where(Job.deleted_at.is_(None))
    .group_by(Job.status, Team.name)
)
_TRIALS = select(SweepTrial.state, func.count(SweepTrial.id)).group_by(SweepTrial.state)


class DatabaseCollector(Collector):
    """The gauges read from the database (cached for ``cache_s``) and this replica's pools."""

    def __init__(self, db: Database, settings: Callable[[], Settings], cache_s: float = CACHE_S) -> None:
        """``settings``: the settings of the moment (the lease that tells a ready node from a
        lost one follows the cluster's size)."""
        self._db = db
        self._settings = settings
        self._cache_s = cache_s
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._cached: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        yield from self._pools()
        with self._lock:
            if time.monotonic() - self._read_at >= self._cache_s:
                self._cached = self._read()
                self._read_at = time.monotonic()
            yield from self._cached

    def _pools(self) -> Iterator[Metric]:
        engines = [("write", self._db.engine)]
        if self._db.read_engine is not self._db.engine:
            engines.append(("read", self._db.read_engine))
        out = GaugeMetricFamily(
            "torchyard_db_pool_checked_out",
            "Database connections of this replica's pool in use now.",
            labels=["pool"],
        )
        size = GaugeMetricFamily(
            "torchyard_db_pool_size",
            "Connections this replica's pool keeps open (more are opened, up to its overflow, "
            "while they are all in use).",
            labels=["pool"],
        )
        for name, engine in engines:
            pool = engine.pool
            if isinstance(pool, QueuePool):
                out.add_metric([name], pool.checkedout())
                size.add_metric([name], pool.size())
        yield out
        yield size

    def _read(self) -> list[Metric]:
        up = GaugeMetricFamily(
            "torchyard_database_up",
            "1 when the last scrape could read the database's gauges, else 0 (they are then absent).",
        )
        try:
            with self._db.read_session() as session:
                jobs = session.execute(_JOBS).all()
                trials = session.execute(_TRIALS).all()
                nodes = session.execute(_NODES).all()
        except Exception:
            log.warning("the metrics could not read the database", exc_info=True)
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        return [up, _jobs(jobs), _trials(trials), *_nodes(nodes, self._settings(), utcnow())]


def _jobs(rows: Iterable[tuple[JobStatus, str | None, int]]) -> Metric:
    family = GaugeMetricFamily(
        "torchyard_jobs",
        "Jobs by state and team (every state listed for every team with jobs, 0 included).",
        labels=["state", "team"],
    )
    counts: dict[str, dict[str, int]] = {}
    for status, team_name, count in rows:
        team = job_team_label(team_name)
        per_state = counts.setdefault(team, {status.value: 0 for status in JobStatus})
        per_state[str(status)] = per_state.get(str(status), 0) + int(count)
    if not counts:
        counts[job_team_label()] = {status.value: 0 for status in JobStatus}
    for team, per_state in sorted(counts.items()):
        for state, count in sorted(per_state.items()):
            family.add_metric([state, team], count)
    return family


def _trials(rows: Iterable[tuple[str, int]]) -> Metric:
    family = GaugeMetricFamily("torchyard_sweep_trials", "Sweep trials by state.", labels=["state"])
    counts = {state.value: 0 for state in TrialState}
    for state, count in rows:
        if state in counts:
            counts[state] += int(count)
    for state, count in sorted(counts.items()):
        family.add_metric([state], count)
    return family


def _nodes(rows: Iterable[tuple[Node, int | None]], settings: Settings, now: datetime) -> list[Metric]:
    by_state: dict[tuple[str, str], int] = {
        (settings.engine, state.value): 0
        for state in (NodeStatus.READY, NodeStatus.LOST, NodeStatus.DRAINING, NodeStatus.DRAINED)
    }
    units: dict[tuple[str, str], int] = {}
    lags: dict[str, list[float]] = {}
    for node, held in rows:
        engine = str(node.engine)
        held = int(held or 0)
        state = node_status(node, settings, now, busy=held > 0)
        by_state[(engine, state.value)] = by_state.get((engine, state.value), 0) + 1
        pool = node_pool(engine, node.info)
        used = min(held, node.units)
        units[(pool, "used")] = units.get((pool, "used"), 0) + used
        free = node.units - used if state is NodeStatus.READY else 0
        units[(pool, "free")] = units.get((pool, "free"), 0) + free
        if state is NodeStatus.READY:
            lags.setdefault(engine, []).append(max((now - node.last_heartbeat_at).total_seconds(), 0.0))
    nodes = GaugeMetricFamily(
        "torchyard_nodes",
        "Nodes by engine and state (ready, lost, draining, drained).",
        labels=["engine", "state"],
    )
    for (engine, state_name), count in sorted(by_state.items()):
        nodes.add_metric([engine, state_name], count)
    pools = GaugeMetricFamily(
        "torchyard_units",
        "Processing units (GPUs, else CPU slots) by pool: used (held by placements not done) "
        "and free (on ready nodes).",
        labels=["pool", "state"],
    )
    if not units:
        units = {(DEFAULT_POOL, "used"): 0, (DEFAULT_POOL, "free"): 0}
    for (pool, used_or_free), count in sorted(units.items()):
        pools.add_metric([pool, used_or_free], count)
    lag = GaugeHistogramMetricFamily(
        "torchyard_node_heartbeat_lag_seconds",
        "Seconds since each ready node was last heard from (a heartbeat, or the engine's "
        "inventory), as a histogram over the ready nodes.",
        labels=["engine"],
    )
    for engine, values in sorted(lags.items()):
        buckets = [(str(float(b)), sum(1 for v in values if v <= b)) for b in HEARTBEAT_LAG_BUCKETS]
        buckets.append(("+Inf", len(values)))
        lag.add_metric([engine], buckets, sum(values))
    return [nodes, pools, lag]
