"""Heartbeats made together: the heartbeats that arrive within a few tens of milliseconds of
each other are made in one transaction (a group commit).

A heartbeat is the hottest request of the API (1,000 nodes send 100 a second), and alone
it is mostly overhead: a trip to a worker thread, the token read, the node read and
locked, its update, the commit — each a round trip to the database and a wait for the
GIL. Made together, the beats of :data:`GATHER_S` share one trip to a thread, one read of
each token, one read of their nodes (locked in name order), one ``UPDATE`` of them
(``executemany``) and one commit. Each beat still gets its own answer and its own error:
an unknown node (404), another agent's node (409), a revoked or non-worker token
(401/403) fail alone, before anything is written. Should the batch fail on anything else
(a deadlock, a database error), each of its beats is made again on its own, in its own
transaction, as a lone heartbeat is.

What a heartbeat does, and answers, is that of :func:`service.services.agents.heartbeat`;
only the transactions it is made in change. A heartbeat waits at most :data:`GATHER_S`
longer than alone, against an interval of seconds and a lease of several intervals.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from service.api.deps import agent_in, agent_session
from service.config import Settings
from service.db.engine import Database
from service.db.models import Node
from service.services import agents
from service.services.nodes import held_by_agent, own_node
from service.services.tokens import USE_RECORDER, Principal
from torchyard.contract.errors import TorchyardError
from torchyard.contract.protocol import HeartbeatResponse

log = logging.getLogger(__name__)

# How long the first heartbeat of a batch waits for others to join it.
GATHER_S = 0.05
# The most heartbeats made in one transaction (one IN list of node names).
MAX_BATCH = 200

# A heartbeat's answer and whether its node came back from ``lost``, or what it raised.
Outcome = tuple[HeartbeatResponse, bool] | Exception


@dataclass(frozen=True)
class Beat:
    """One node's heartbeat, as its request carried it."""

    token: str | None
    name: str
    agent_key: str | None
    leases: list[str] = field(default_factory=list)


def make_beats(db: Database, settings: Settings, beats: Sequence[Beat]) -> list[Outcome]:
    """Make ``beats``: together in one transaction, or each alone if that fails (see the
    module's docstring). One outcome per beat, in order."""
    if len(beats) > 1:
        try:
            return _together(db, settings, beats)
        except Exception as exc:
            log.info("%d heartbeats made one by one: together they failed (%s)", len(beats), exc)
    return [_alone(db, settings, beat) for beat in beats]


def _alone(db: Database, settings: Settings, beat: Beat) -> Outcome:
    try:
        with agent_session(db, beat.token) as (session, worker):
            return agents.heartbeat(session, settings, worker, beat.name, beat.agent_key, beat.leases)
    except Exception as exc:
        return exc


def _together(db: Database, settings: Settings, beats: Sequence[Beat]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    recorded: list[str] = []
    try:
        with db.session() as session:
            principals = _principals(session, beats, recorded)
            names = sorted({b.name for b in beats if isinstance(principals[b.token], Principal)})
            rows = session.scalars(_NODES_FOR_UPDATE, {"names": names}).all() if names else []
            by_name = {node.name: node for node in rows}
            for beat in beats:
                principal = principals[beat.token]
                try:
                    if isinstance(principal, TorchyardError):
                        raise principal
                    node = held_by_agent(
                        own_node(by_name.get(beat.name), principal, beat.name), beat.agent_key
                    )
                except TorchyardError as exc:  # this beat's own error: nothing of it was written
                    outcomes.append(exc)
                    continue
                outcomes.append(agents.heartbeat_on(session, settings, principal, node, beat.leases))
            session.commit()
    except BaseException:
        for token_id in recorded:
            USE_RECORDER.failed(token_id)
        raise
    return outcomes


def _principals(
    session: Session, beats: Sequence[Beat], recorded: list[str]
) -> dict[str | None, Principal | TorchyardError]:
    """Each distinct token of ``beats`` read once: its resident agent, or why it is refused.
    The ids of the tokens whose due last use was written are added to ``recorded``."""
    found: dict[str | None, Principal | TorchyardError] = {}
    for beat in beats:
        if beat.token in found:
            continue
        try:
            principal, recording = agent_in(session, beat.token)
        except TorchyardError as exc:  # refused (401/403); a database error fails the batch
            found[beat.token] = exc
            continue
        found[beat.token] = principal
        if recording:
            recorded.append(principal.id)
    return found


# The nodes of a batch, locked in name order (two batches lock shared nodes in one order).
_NODES_FOR_UPDATE = (
    select(Node)
    .where(Node.name.in_(bindparam("names", expanding=True)))
    .order_by(Node.name)
    .with_for_update()
)


class HeartbeatBatcher:
    """Gathers the heartbeats of one API process (its event loop) into batches made in the
    heartbeats' worker-thread lane."""

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self._limiter = limiter
        self._pending: list[tuple[Beat, asyncio.Future[tuple[HeartbeatResponse, bool]]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._context: tuple[Database, Settings] | None = None
        self._running: set[asyncio.Task[None]] = set()
        # Batches made so far and the heartbeats in them (what the tests count).
        self.batches = 0
        self.beats = 0

    async def beat(self, db: Database, settings: Settings, beat: Beat) -> tuple[HeartbeatResponse, bool]:
        """Make ``beat`` with the others that arrive meanwhile; its answer, or its error raised."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[HeartbeatResponse, bool]] = loop.create_future()
        self._pending.append((beat, future))
        self._context = (db, settings)  # the newest settings (the timing follows the cluster)
        if len(self._pending) >= MAX_BATCH:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(GATHER_S, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if not batch or self._context is None:
            return
        task = asyncio.get_running_loop().create_task(self._run(self._context, batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(
        self,
        context: tuple[Database, Settings],
        batch: list[tuple[Beat, asyncio.Future[tuple[HeartbeatResponse, bool]]]],
    ) -> None:
        db, settings = context
        beats = [beat for beat, _ in batch]
        try:
            outcomes = await anyio.to_thread.run_sync(make_beats, db, settings, beats, limiter=self._limiter)
        except BaseException:  # cancelled: the process is stopping
            for _, future in batch:
                future.cancel()
            raise
        self.batches += 1
        self.beats += len(batch)
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():
                continue  # its request went away (the agent disconnected)
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
