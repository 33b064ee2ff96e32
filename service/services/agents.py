"""What each call of a worker agent does, each in transactions of its own.

The worker routes parse the request, call one function here and shape the answer;
these own the commits and the follow-up work (losing a restarted node's placements).
Scheduling passes run out of the request path: the routes ask the replica's
:class:`~service.services.scheduler_loop.SchedulerLoop` for one after the commit, where
these functions say that capacity changed.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Node
from service.services import claims, drain, nodes, placement_reports
from service.services.lost_placements import lose_node_placements, unfinished_placements
from service.services.tokens import Principal
from service.states import NodeStatus
from torchyard.contract.protocol import (
    HeartbeatResponse,
    NodeRegister,
    PlacementStatusReport,
    PlacementStatusResponse,
)
from torchyard.contract.responses import NodeDrained


def register(
    session: Session, db: Database, settings: Settings, worker: Principal, body: NodeRegister
) -> Node:
    """Register (or re-register) the node and commit; then whatever its earlier agent was
    running is lost."""
    node = nodes.register_node(
        session,
        worker,
        name=body.name,
        address=body.address,
        units=body.units,
        accelerator=body.accelerator,
        info=body.info,
        agent_key=body.agent_key,
        lease_timeout_s=settings.lease_timeout_s,
    )
    # What the node's earlier agent ran, read while the node's row is locked. A placement it
    # never claimed has no process behind it: the new agent claims it as its own (after a
    # quick restart the scheduler may have placed a job on the node a moment before), and
    # so does work placed once this registration commits.
    earlier = unfinished_placements(session, node.id, claimed_only=True)
    session.commit()
    if earlier:
        lose_node_placements(db, node.id, f"the worker agent on node {node.name} restarted", rows=earlier)
    return node


def heartbeat(
    session: Session,
    settings: Settings,
    worker: Principal,
    name: str,
    agent_key: str | None,
    leases: list[str],
) -> tuple[HeartbeatResponse, bool]:
    """Check the agent holds the node, renew its leases, and commit. Returns the answer and
    whether the node came back from ``lost`` (capacity for a scheduling pass)."""
    node = nodes.check_agent(session, worker, name, agent_key, for_update=True)
    answer, revived = heartbeat_on(session, settings, worker, node, leases)
    session.commit()
    return answer, revived


def heartbeat_on(
    session: Session, settings: Settings, worker: Principal, node: Node, leases: list[str]
) -> tuple[HeartbeatResponse, bool]:
    """:func:`heartbeat` on ``node``, already checked and locked; the caller commits."""
    was_lost = node.status == NodeStatus.LOST
    answer = nodes.heartbeat(session, settings, node, leases)
    return answer, was_lost and answer.status == NodeStatus.READY


def claim_once(
    db: Database,
    settings: Settings,
    worker: Principal,
    name: str,
    agent_key: str | None,
    fresh: bool = True,
) -> claims.ClaimCheck:
    """One claim check in its own transaction: the node's next placement, if a pass put one
    there. ``fresh``: the agent's request has just arrived, rather than a long-poll
    re-checked (see :func:`claims.claim`)."""
    with db.session() as session:
        return claim_in(session, settings, worker, name, agent_key, fresh)


def claim_in(
    session: Session,
    settings: Settings,
    worker: Principal,
    name: str,
    agent_key: str | None,
    fresh: bool = True,
) -> claims.ClaimCheck:
    """:func:`claim_once` in the caller's session (it commits)."""
    nodes.check_agent(session, worker, name, agent_key)
    check = claims.claim(session, settings, worker, name, fresh=fresh)
    session.commit()
    return check


def work_pending(db: Database, node_id: str) -> bool:
    """Whether a pass has assigned the node a placement (its own rows only)."""
    with db.read_session() as session:
        return claims.work_pending(session, node_id)


def report_status(
    session: Session,
    db: Database,
    settings: Settings,
    worker: Principal,
    lease: str | None,
    report: PlacementStatusReport,
) -> tuple[PlacementStatusResponse, bool]:
    """Apply a placement's status report and commit. Returns the answer and whether the
    placement ended (its units are free: a scheduling pass may place more)."""
    answer, ended = placement_reports.report_status(session, worker, lease, report)
    session.commit()
    return answer, ended


def _drained(result: drain.DrainResult, *, show_jobs: bool) -> NodeDrained:
    return NodeDrained(
        name=result.name,
        status=result.status,
        drained_by=result.drained_by,
        preempted_jobs=result.preempted_jobs if show_jobs else [],
    )


def drain_own_node(
    session: Session, db: Database, settings: Settings, worker: Principal, name: str, agent_key: str | None
) -> NodeDrained:
    """The agent drains its own node (it got SIGTERM), and commits; a scheduling pass should
    follow, since preempted jobs are queued again."""
    node = nodes.check_agent(session, worker, name, agent_key)
    result = drain.drain(session, settings, node, "agent")
    session.commit()
    return _drained(result, show_jobs=False)


def drain_by_admin(session: Session, db: Database, settings: Settings, ref: str) -> NodeDrained:
    """An admin drains a node by id or name, and commits; a scheduling pass should follow."""
    node = drain.find_node(session, ref, for_update=True)
    result = drain.drain(session, settings, node, "admin")
    session.commit()
    return _drained(result, show_jobs=True)


def undrain_by_admin(session: Session, db: Database, settings: Settings, ref: str) -> NodeDrained:
    """An admin makes a drained node ready again, and commits; a scheduling pass should follow."""
    node = drain.find_node(session, ref, for_update=True)
    result = drain.undrain(session, settings, node)
    session.commit()
    return _drained(result, show_jobs=True)
