"""One-placement launchers (docs/slurm.md): what an engine's compute node runs for one attempt.

An engine (Slurm) starts one launcher per node of an attempt, with a *launch token*: a
worker token scoped to that attempt (``tokens.attempt_id``), minted when the attempt is
handed to the engine and revoked when the engine's job ends. It reaches the worker
routes of its own attempt's placements only (leases, reports, uploads, its datasets and
code), never a node's register, heartbeat or claim.

The first launcher to check in binds the attempt's placements: node rank ``i`` goes to
``nodes[i]`` (the engine's allocation in order), the rendezvous to node rank 0's
address. Each launcher then takes its own rank's placement (its lease starts there),
heartbeats its lease here, and reports exactly as an agent does.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Attempt, Job, Node, Placement, Token
from service.db.types import new_id, utcnow
from service.engines import capabilities_of
from service.services.claims import claimed_placement
from service.services.jobs import transition
from service.services.leases import renew_leases
from service.services.scheduler import new_placement, pick_port
from service.services.tokens import TOKEN_PREFIX, Principal, hash_token
from service.services.transitions import set_placement_status
from service.states import (
    LIVE_ATTEMPT_STATUSES,
    PLACED_STATUSES,
    AttemptStatus,
    EngineName,
    JobStatus,
    NodeStatus,
    PlacementStatus,
    Role,
)
from torchyard.contract.errors import ConflictError, NotBoundYetError, PermissionDeniedError, StaleLeaseError
from torchyard.contract.protocol import ClaimedPlacement, HeartbeatResponse, LaunchCheckIn


def engine_owner(session: Session, engine: EngineName) -> str:
    """The id of the token that owns an engine's node rows: a worker token nobody holds
    (its hash is of a value never kept), so no agent can register or speak for those nodes."""
    name = f"{engine} engine"
    row = session.scalars(
        select(Token).where(Token.name == name, Token.role == Role.WORKER, Token.attempt_id.is_(None))
    ).first()
    if row is None:
        row = Token(id=new_id(), name=name, role=Role.WORKER, token_hash=hash_token(secrets.token_hex(32)))
        session.add(row)
        session.flush()
    return row.id


def start_attempt(session: Session, job: Job, engine: EngineName, message: str) -> tuple[Attempt, str]:
    """Hand a queued job (its row held by the caller) to an engine: a new attempt whose
    placements are bound when its launchers check in, the job ``scheduled`` (``message``
    says where), and the attempt's launch token. The caller commits."""
    now = utcnow()
    job.attempts_count = (job.attempts_count or 0) + 1
    attempt = Attempt(
        job_id=job.id,
        number=job.attempts_count,
        status=AttemptStatus.SCHEDULED,
        master_addr="",
        master_port=0,
        engine=engine,
        created_at=now,
    )
    session.add(attempt)
    session.flush()
    transition(session, job, JobStatus.SCHEDULED, message)
    return attempt, issue_launch_token(session, attempt)


def issue_launch_token(session: Session, attempt: Attempt) -> str:
    """A fresh launch token for ``attempt`` (any earlier one of it is revoked). The caller
    commits before handing the token to the engine."""
    revoke_launch_tokens(session, attempt.id)
    plain = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(
        Token(
            name=f"launch {attempt.job_id} attempt {attempt.number}",
            role=Role.WORKER,
            token_hash=hash_token(plain),
            attempt_id=attempt.id,
        )
    )
    session.flush()
    return plain


def revoke_launch_tokens(session: Session, attempt_id: str) -> None:
    session.execute(
        update(Token)
        .where(Token.attempt_id == attempt_id, Token.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def lock_attempt(session: Session, attempt_id: str) -> tuple[Job, Attempt]:
    """The attempt's job, then the attempt, locked in that order (the order every writer of
    both takes), the attempt read again under its lock."""
    attempt = session.get_one(Attempt, attempt_id)
    job = session.scalars(select(Job).where(Job.id == attempt.job_id).with_for_update()).one()
    attempt = session.scalars(
        select(Attempt)
        .where(Attempt.id == attempt_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one()
    return job, attempt


def _own_attempt(principal: Principal, attempt_id: str) -> None:
    if principal.attempt_id != attempt_id:
        raise PermissionDeniedError("this launch token belongs to another attempt")


def check_in(
    session: Session, settings: Settings, principal: Principal, attempt_id: str, body: LaunchCheckIn
) -> ClaimedPlacement:
    """Hand the launcher its node rank's placement (binding the attempt's placements first if
    it is the first to check in), and commit.

    409 ``StaleLeaseError`` when the attempt is over (the launcher must exit without running)
    or this node rank already checked in; 409 ``ConflictError`` when the allocation does not
    match the job's shape or another launcher bound it differently.
    """
    _own_attempt(principal, attempt_id)
    job, attempt = lock_attempt(session, attempt_id)
    if attempt.status not in LIVE_ATTEMPT_STATUSES or job.status not in PLACED_STATUSES:
        raise StaleLeaseError(
            f"attempt {attempt.number} of job {job.id} is {attempt.status} (job {job.status})"
        )
    placements = list(
        session.scalars(
            select(Placement)
            .where(Placement.attempt_id == attempt.id)
            .order_by(Placement.node_rank)
            .with_for_update()
        )
    )
    if not placements:
        if capabilities_of(attempt.engine).binds_ranks:
            # The engine says where each rank runs (a pod's node): the reconciler binds them.
            raise NotBoundYetError(
                f"the nodes of attempt {attempt.number} of job {job.id} are not all bound yet; try again"
            )
        placements = bind_ranks(session, settings, job, attempt, body.nodes, {body.node: body.address})
    if body.node_rank >= len(placements):
        raise ConflictError(
            f"node rank {body.node_rank} is not part of attempt {attempt.number} ({len(placements)} nodes)"
        )
    placement = placements[body.node_rank]
    node = session.get_one(Node, placement.node_id)
    if node.name != body.node:
        raise ConflictError(
            f"node rank {body.node_rank} of attempt {attempt.number} is {node.name}, not {body.node}"
        )
    if placement.status != PlacementStatus.ASSIGNED:
        raise StaleLeaseError(f"node rank {body.node_rank} of attempt {attempt.number} already checked in")
    now = utcnow()
    set_placement_status(placement, PlacementStatus.RUNNING, now)
    placement.lease_expires_at = now + timedelta(seconds=settings.lease_timeout_s)
    claimed = claimed_placement(session, placement, settings)
    session.commit()
    return claimed


def bind_ranks(
    session: Session,
    settings: Settings,
    job: Job,
    attempt: Attempt,
    nodes: list[str],
    addresses: dict[str, str],
) -> list[Placement]:
    """Node rank ``i`` on ``nodes[i]``; the rendezvous at node rank 0's address (from
    ``addresses`` where it has it, else its node row's). The caller holds the job and the
    attempt locked."""
    if len(nodes) != job.node_count or len(set(nodes)) != len(nodes):
        raise ConflictError(
            f"the allocation has nodes {nodes}; job {job.id} needs {job.node_count} distinct node(s)"
        )
    now = utcnow()
    rows: list[Node] = []
    for name in nodes:
        node = session.scalars(select(Node).where(Node.name == name)).first()
        if node is None:
            # Not in the inventory yet (it polls every few seconds): known from now on.
            node = Node(
                name=name,
                address=addresses.get(name, name),
                units=job.process_count_per_node,
                accelerator="unknown",
                status=NodeStatus.READY,
                token_id=engine_owner(session, attempt.engine),
                engine=attempt.engine,
                registered_at=now,
                last_heartbeat_at=now,
            )
            session.add(node)
            session.flush()
        rows.append(node)
    master = addresses.get(nodes[0]) or rows[0].address
    port = pick_port(session, settings, master, {})
    if port is None:
        raise ConflictError(f"no free rendezvous port on {master}")
    attempt.master_addr = master
    attempt.master_port = port
    expires = now + timedelta(seconds=settings.lease_timeout_s)
    placements = []
    for rank, node in enumerate(rows):
        placement = new_placement(attempt, job, node.id, rank, expires, now)
        session.add(placement)
        placements.append(placement)
    job.wait_reason = None
    session.flush()
    return placements


def heartbeat(
    session: Session, settings: Settings, principal: Principal, attempt_id: str, node: str, leases: list[str]
) -> HeartbeatResponse:
    """Renew the launcher's leases (its attempt's only) and say which must stop; commits."""
    _own_attempt(principal, attempt_id)
    renewed, stop = renew_leases(session, settings, leases, owns=lambda p: p.attempt_id == attempt_id)
    session.commit()
    return HeartbeatResponse(
        node=node,
        status=NodeStatus.READY,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        lease_timeout_s=settings.lease_timeout_s,
        renewed=renewed,
        stop=stop,
    )
