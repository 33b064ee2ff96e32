"""Worker routes: node registration, heartbeats, claims and everything an agent reports.

Only worker tokens reach them (403 for user and admin tokens). Every write about a
placement carries its lease token in the ``X-Torchyard-Lease`` header; a stale one
gets 409 ``StaleLeaseError``. Heartbeats and claims carry the agent's per-node key in
``X-Torchyard-Agent-Key``; a key other than the one the node was last registered with
gets 409 ``NodeNameInUseError`` (another agent holds the node now).
"""

from __future__ import annotations

import asyncio
import random
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, Response, status
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.api.deps import (
    AgentDep,
    AgentKeyDep,
    DatabaseDep,
    LauncherDep,
    LeaseHeader,
    SchedulingDep,
    SessionDep,
    SettingsDep,
    TokenDep,
    WakeupDep,
    WorkerDep,
    agent_session,
)
from service.api.heartbeats import Beat, HeartbeatBatcher
from service.api.routing import SessionScopedRoute
from service.config import Settings
from service.db.engine import Database
from service.db.models import Node
from service.services import agents, claims, launches
from service.services.node_timing import NodeTiming
from service.services.tokens import Principal
from torchyard.contract.errors import NotBoundYetError
from torchyard.contract.protocol import (
    AnyClaimedPlacement,
    ClaimedPlacement,
    HeartbeatRequest,
    HeartbeatResponse,
    LaunchCheckIn,
    NodeRegister,
    NodeRegistered,
    PlacementStatusReport,
    PlacementStatusResponse,
)
from torchyard.contract.responses import NodeDrained

# A parked claim looks at least this often whether its agent is still connected.
_DISCONNECT_CHECK_S = 5.0
# The longest a claim waits for a scheduling pass this replica owes before its first answer.
_OWED_PASS_WAIT_S = 5.0
# Worker threads kept for heartbeats alone: a heartbeat never queues for a thread behind
# other work (a herd of claims, a burst of submissions), so leases are renewed on time.
HEARTBEAT_THREADS = 4
# At most this many claim checks at once: a herd of long-polls (every node registered
# together) waits on the event loop, not in threads contending for the GIL and connections.
CLAIM_THREADS = 8
# At most this many registrations at once, for the same reason: when a whole cluster's agents
# start together, their registrations queue on the event loop while the first nodes'
# heartbeats keep being answered.
REGISTRATION_THREADS = 4
# A long-poll at least this long ends at a random point of its last fifth: nodes that
# registered together do not all come back at the same moment, every time.
_JITTER_FROM_S = 10.0


class Lanes:
    """The worker-thread budgets of the hot worker routes, per API process (its event loop):
    heartbeats, claims and registrations each have their own, apart from every other
    request's."""

    def __init__(self) -> None:
        self.heartbeats = anyio.CapacityLimiter(HEARTBEAT_THREADS)
        self.claims = anyio.CapacityLimiter(CLAIM_THREADS)
        self.registrations = anyio.CapacityLimiter(REGISTRATION_THREADS)
        # Heartbeats arriving together are made together, in the heartbeats' lane.
        self.heartbeat_batches = HeartbeatBatcher(self.heartbeats)


router = APIRouter(prefix="/v1/worker", tags=["worker"], route_class=SessionScopedRoute)


@router.post("/nodes")
async def register_node(
    request: Request,
    body: NodeRegister,
    session: SessionDep,
    db: DatabaseDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    worker: AgentDep,
) -> NodeRegistered:
    """Register (or re-register) this agent's node; the answer carries the timing it must keep.

    An agent registers when it starts: whatever the node ran before is gone (a new agent
    kills what an earlier one left), so placements still open on the node are lost now
    rather than when their leases run out. The name belongs to the worker token that
    first registered it, and to one live agent (``agent_key``) at a time: anyone else
    gets 409 ``NodeNameInUseError`` and changes nothing.
    """
    node, timing = await anyio.to_thread.run_sync(
        _register, request, session, db, settings, worker, body, limiter=_lanes(request).registrations
    )
    scheduling.request()  # new (or freed) capacity
    return NodeRegistered(
        id=node.id,
        name=node.name,
        status=node.status,
        heartbeat_interval_s=timing.heartbeat_interval_s,
        lease_timeout_s=timing.lease_timeout_s,
        claim_poll_timeout_s=timing.claim_poll_timeout_s,
    )


def _register(
    request: Request,
    session: Session,
    db: Database,
    settings: Settings,
    worker: Principal,
    body: NodeRegister,
) -> tuple[Node, Settings]:
    """Register the node, then count the nodes again: the answer carries the heartbeat
    interval and lease for the cluster with this node in it (:mod:`service.services.node_timing`)."""
    node = agents.register(session, db, settings, worker, body)
    timing: NodeTiming = request.app.state.timing
    return node, timing.refresh(db)


@router.post("/nodes/{name}/heartbeat")
async def heartbeat(
    request: Request,
    name: str,
    body: HeartbeatRequest,
    db: DatabaseDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    token: TokenDep,
    agent_key: AgentKeyDep,
) -> HeartbeatResponse:
    """Keep the node ready and renew the leases it lists; ``stop`` names placements whose ranks
    must be stopped now (job cancelling, attempt failed elsewhere, lease stale).

    The hottest route (every node, every few seconds): the heartbeats arriving together are
    made together, the token checked and the heartbeat made in one transaction with theirs,
    in one trip to a worker thread (:mod:`service.api.heartbeats`); a trip costs most when
    the machine is busy (a wait for a thread and for the GIL)."""
    answer, revived = await _lanes(request).heartbeat_batches.beat(
        db, settings, Beat(token, name, agent_key, body.leases)
    )
    if revived:
        scheduling.request()
    return answer


def _lanes(request: Request) -> Lanes:
    lanes: Lanes = request.app.state.lanes
    return lanes


@router.post("/nodes/{name}/drain")
async def drain_node(
    name: str,
    session: SessionDep,
    db: DatabaseDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    worker: AgentDep,
    agent_key: AgentKeyDep,
) -> NodeDrained:
    """The agent drains its own node (it got SIGTERM: a spot node reclaimed, a pod evicted): the
    node takes no new work, and its placements get ``preempted`` stop orders at the next
    heartbeat. A new agent registering the node makes it ready again."""
    answer = await run_in_threadpool(agents.drain_own_node, session, db, settings, worker, name, agent_key)
    scheduling.request()  # preempted jobs are queued again
    return answer


@router.post(
    "/nodes/{name}/claim",
    response_model=AnyClaimedPlacement,
    responses={204: {"description": "No work arrived before the wait ran out."}},
)
async def claim(
    name: str,
    request: Request,
    db: DatabaseDep,
    settings: SettingsDep,
    wakeup: WakeupDep,
    scheduling: SchedulingDep,
    token: TokenDep,
    agent_key: AgentKeyDep,
    wait: Annotated[float, Query(ge=0, le=3600, description="Seconds to wait for work (long-poll).")] = 0.0,
) -> Any:
    """Long-poll for the node's next placement: 200 with it, or 204 when ``wait`` ran out.

    A claim never schedules: it reads the node's own placements only. The wait holds
    neither a thread nor a database connection: it sleeps until a scheduling pass (of any
    replica) places work on this node. A scheduling pass this replica still owes (a
    submission just made here) is waited for before the first answer. Only while
    notifications from other replicas may be missed (the listener reconnecting) does the
    wait re-read the node's placements every ``claim_recheck_interval_s``.
    """
    loop = asyncio.get_running_loop()
    wait = min(wait, settings.claim_poll_timeout_s)
    if wait >= _JITTER_FROM_S:
        wait *= random.uniform(0.8, 1.0)
    deadline = loop.time() + wait
    # The token checked and the first look made in one trip to a worker thread.
    lane = _lanes(request).claims
    stamp = wakeup.stamp()
    worker, check = await anyio.to_thread.run_sync(
        _first_claim, db, settings, token, name, agent_key, limiter=lane
    )
    if check.placement is not None:
        return check.placement
    node_id = check.node_id
    if check.revived:
        scheduling.request()  # the node came back from lost: capacity for a pass
    owed = scheduling.pending()
    if owed is not None:
        # A change this replica took in (a submission just made here) is not scheduled yet:
        # its pass decides the first answer, even of a claim that does not wait.
        await scheduling.settled(owed, max(deadline - loop.time(), _OWED_PASS_WAIT_S))
    generation = wakeup.generation(node_id)
    # Look again before waiting only if a pass may have placed work since the first look
    # (an owed pass ran, or any notification came in meanwhile): otherwise the generation
    # read now is as good as one read before that look, and the wait misses nothing.
    notified = owed is not None or wakeup.stamp() != stamp
    while True:
        if notified or not wakeup.reliable:
            generation = wakeup.generation(node_id)
            if await request.is_disconnected():
                # The agent went away (or restarted): end the wait, and hand it nothing.
                return Response(status_code=status.HTTP_204_NO_CONTENT)
            placement = await _take_assigned(db, settings, worker, name, agent_key, node_id, lane)
            if placement is not None:
                return placement
        remaining = deadline - loop.time()
        if remaining <= 0 or await request.is_disconnected():
            return Response(status_code=status.HTTP_204_NO_CONTENT)
        timeout = remaining if wakeup.reliable else min(remaining, settings.claim_recheck_interval_s)
        notified = await wakeup.wait(node_id, generation, min(timeout, _DISCONNECT_CHECK_S))


def _first_claim(
    db: Database, settings: Settings, token: str | None, name: str, agent_key: str | None
) -> tuple[Principal, claims.ClaimCheck]:
    with agent_session(db, token) as (session, worker):
        return worker, agents.claim_in(session, settings, worker, name, agent_key, True)


async def _take_assigned(
    db: Database,
    settings: Settings,
    worker: Principal,
    name: str,
    agent_key: str | None,
    node_id: str,
    lane: anyio.CapacityLimiter,
) -> ClaimedPlacement | None:
    """The node's next placement if a pass assigned it one (a cheap read first, then the
    claim's write transaction)."""
    if not await anyio.to_thread.run_sync(agents.work_pending, db, node_id, limiter=lane):
        return None
    check = await anyio.to_thread.run_sync(
        agents.claim_once, db, settings, worker, name, agent_key, False, limiter=lane
    )
    return check.placement


@router.post("/placements/status")
async def report_status(
    body: PlacementStatusReport,
    session: SessionDep,
    db: DatabaseDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> PlacementStatusResponse:
    """Report a placement's state: ``running`` once its ranks started, then ``succeeded``
    (node rank 0 after uploading the model), ``failed`` (with the failure) or ``cancelled``
    (ranks stopped on request). ``stop`` in the answer tells the agent to stop its ranks."""
    answer, ended = await run_in_threadpool(agents.report_status, session, db, settings, worker, lease, body)
    if ended:
        scheduling.request()  # the placement's units are free
    return answer


@router.post("/attempts/{attempt_id}/check-in", response_model=AnyClaimedPlacement)
def launch_check_in(
    attempt_id: str,
    body: LaunchCheckIn,
    session: SessionDep,
    settings: SettingsDep,
    launcher: LauncherDep,
    scheduling: SchedulingDep,
) -> ClaimedPlacement:
    """A one-placement launcher (docs/slurm.md) takes its node rank's placement of the attempt its
    launch token belongs to; the first one to check in binds every node rank to the
    allocation's nodes. 409 when the attempt is over or the rank already checked in; 425 when
    its engine has not said yet where every rank runs (Kubernetes): a pass is asked for, which
    binds them, and the launcher tries again."""
    try:
        return launches.check_in(session, settings, launcher, attempt_id, body)
    except NotBoundYetError:
        scheduling.request()
        raise


@router.post("/attempts/{attempt_id}/heartbeat")
def launch_heartbeat(
    attempt_id: str,
    body: HeartbeatRequest,
    session: SessionDep,
    settings: SettingsDep,
    launcher: LauncherDep,
    node: Annotated[str, Query(max_length=200, description="The launcher's node, for the answer.")] = "",
) -> HeartbeatResponse:
    """A launcher renews its placement's lease; ``stop`` says when its ranks must stop."""
    return launches.heartbeat(session, settings, launcher, attempt_id, node, body.leases)
