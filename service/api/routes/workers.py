"""Worker routes: node registration, heartbeats, claims and everything an agent reports.

Only worker tokens reach them (403 for user and admin tokens). Every write about a
placement carries its lease token in the ``X-Torchyard-Lease`` header; a stale one
gets 409 ``StaleLeaseError``. Heartbeats and claims carry the agent's per-node key in
``X-Torchyard-Agent-Key``; a key other than the one the node was last registered with
gets 409 ``NodeNameInUseError`` (another agent holds the node now).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, status
from starlette.concurrency import run_in_threadpool

from service.api.deps import (
    AgentKeyDep,
    DatabaseDep,
    LeaseHeader,
    SessionDep,
    SettingsDep,
    WakeupDep,
    WorkerDep,
)
from service.api.routing import SessionScopedRoute
from service.schemas.nodes import NodeDrained, NodeRegister
from service.services import agents
from torchyard.contract.protocol import (
    ClaimedPlacement,
    HeartbeatRequest,
    HeartbeatResponse,
    NodeRegistered,
    PlacementStatusReport,
    PlacementStatusResponse,
)

router = APIRouter(prefix="/v1/worker", tags=["worker"], route_class=SessionScopedRoute)


@router.post("/nodes")
def register_node(
    body: NodeRegister, session: SessionDep, db: DatabaseDep, settings: SettingsDep, worker: WorkerDep
) -> NodeRegistered:
    """Register (or re-register) this agent's node; the answer carries the timing it must keep.

    An agent registers when it starts: whatever the node ran before is gone (a new agent
    kills what an earlier one left), so placements still open on the node are lost now
    rather than when their leases run out. The name belongs to the worker token that
    first registered it, and to one live agent (``agent_key``) at a time: anyone else
    gets 409 ``NodeNameInUseError`` and changes nothing.
    """
    node = agents.register(session, db, settings, worker, body)
    return NodeRegistered(
        id=node.id,
        name=node.name,
        status=node.status,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        lease_timeout_s=settings.lease_timeout_s,
        claim_poll_timeout_s=settings.claim_poll_timeout_s,
    )


@router.post("/nodes/{name}/heartbeat")
def heartbeat(
    name: str,
    body: HeartbeatRequest,
    session: SessionDep,
    settings: SettingsDep,
    worker: WorkerDep,
    agent_key: AgentKeyDep,
) -> HeartbeatResponse:
    """Keep the node ready and renew the leases it lists; ``stop`` names placements whose ranks
    must be stopped now (job cancelling, attempt failed elsewhere, lease stale)."""
    return agents.heartbeat(session, settings, worker, name, agent_key, body.leases)


@router.post("/nodes/{name}/drain")
def drain_node(
    name: str,
    session: SessionDep,
    db: DatabaseDep,
    settings: SettingsDep,
    wakeup: WakeupDep,
    worker: WorkerDep,
    agent_key: AgentKeyDep,
) -> NodeDrained:
    """The agent drains its own node (it got SIGTERM: a spot node reclaimed, a pod evicted): the
    node takes no new work, and its placements get ``preempted`` stop orders at the next
    heartbeat. A new agent registering the node makes it ready again."""
    answer = agents.drain_own_node(session, db, settings, worker, name, agent_key)
    wakeup.notify()
    return answer


@router.post(
    "/nodes/{name}/claim",
    response_model=ClaimedPlacement,
    responses={204: {"description": "No work arrived before the wait ran out."}},
)
async def claim(
    name: str,
    request: Request,
    db: DatabaseDep,
    settings: SettingsDep,
    wakeup: WakeupDep,
    worker: WorkerDep,
    agent_key: AgentKeyDep,
    wait: Annotated[float, Query(ge=0, le=3600, description="Seconds to wait for work (long-poll).")] = 0.0,
) -> Any:
    """Long-poll for the node's next placement: 200 with it, or 204 when ``wait`` ran out.

    The wait holds neither a thread nor a database connection: it sleeps on an event that
    this replica sets when it queues or places work, and re-reads the database every
    ``claim_recheck_interval_s`` for work placed by other replicas.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait, settings.claim_poll_timeout_s)
    full_check = True
    fresh = True  # the first check is the agent's own request; later ones are the API's
    newest_seen: datetime | None = None
    while True:
        if await request.is_disconnected():
            # The agent went away (or restarted): end the wait instead of holding the request.
            return Response(status_code=status.HTTP_204_NO_CONTENT)
        generation = wakeup.generation
        if not full_check:
            pending, newest = await run_in_threadpool(agents.work_pending, db, worker, name)
            if pending or (newest is not None and (newest_seen is None or newest > newest_seen)):
                full_check = True
            newest_seen = newest if newest is not None else newest_seen
        if full_check:
            claimed, placed = await run_in_threadpool(
                agents.claim_once, db, settings, worker, name, agent_key, fresh
            )
            fresh = False
            if placed:
                wakeup.notify()  # the pass may have placed work on other waiting nodes
            if claimed is not None:
                return claimed
        remaining = deadline - loop.time()
        if remaining <= 0:
            return Response(status_code=status.HTTP_204_NO_CONTENT)
        full_check = await wakeup.wait(generation, min(remaining, settings.claim_recheck_interval_s))


@router.post("/placements/status")
def report_status(
    body: PlacementStatusReport,
    session: SessionDep,
    db: DatabaseDep,
    settings: SettingsDep,
    wakeup: WakeupDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> PlacementStatusResponse:
    """Report a placement's state: ``running`` once its ranks started, then ``succeeded``
    (node rank 0 after uploading the model), ``failed`` (with the failure) or ``cancelled``
    (ranks stopped on request). ``stop`` in the answer tells the agent to stop its ranks."""
    answer, placed = agents.report_status(session, db, settings, worker, lease, body)
    if placed:
        wakeup.notify()
    return answer
