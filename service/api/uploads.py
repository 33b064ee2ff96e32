"""The one path of every lease-fenced upload of a worker (model, outputs, checkpoint).

In order: the placement's lease is checked before any byte is read (409 on a stale lease,
403 for the wrong node), a declared length over the limit is refused (413), the body is
streamed to a staging file (1 MiB writes, off the event loop), the kind's own checks run
on it, and the kind publishes it in a write transaction that checks the lease again. A
refusal at any step keeps nothing: the staging file goes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.api.files import receive_body, refuse_oversized
from service.db.engine import Database
from service.services.artifacts import check_sha256_matches
from service.services.incoming import IncomingUpload

Incoming = TypeVar("Incoming", bound=IncomingUpload)
Checked = TypeVar("Checked")
Published = TypeVar("Published")


@dataclass(frozen=True)
class Upload(Generic[Checked, Published]):
    """What an upload stored: its checksum and size, what its checks found and what its
    publication returned."""

    sha256: str
    size: int
    checked: Checked
    published: Published


def _authorize(db: Database, authorize: Callable[[Session], None]) -> None:
    with db.read_session() as session:
        authorize(session)


def _publish(
    db: Database,
    publish: Callable[[Session, Incoming, str], Published],
    incoming: Incoming,
    sha: str,
) -> Published:
    with db.session() as session:
        return publish(session, incoming, sha)


async def receive_fenced_upload(
    request: Request,
    db: Database,
    *,
    what: str,
    announced: str,
    limit: int,
    authorize: Callable[[Session], None],
    start: Callable[[int], Incoming],
    check: Callable[[Incoming], Checked],
    publish: Callable[[Session, Incoming, str], Published],
) -> Upload[Checked, Published]:
    """Receive one upload under the placement's lease (see the module's docstring).

    ``announced`` is the checksum of the ``X-Torchyard-Sha256`` header (422 unless the body
    hashes to it); ``authorize(session)`` refuses a wrong lease before the body is read;
    ``start(limit)`` opens the staging file; ``check(incoming)`` runs the kind's checks on the
    whole body (off the event loop); ``publish(session, incoming, sha256)`` stores it.
    """
    await run_in_threadpool(_authorize, db, authorize)
    refuse_oversized(request, limit, what)
    incoming = await run_in_threadpool(start, limit)
    try:
        actual = await receive_body(request, incoming)
        check_sha256_matches(announced, actual)
        checked = await run_in_threadpool(check, incoming)
        published = await run_in_threadpool(_publish, db, publish, incoming, actual)
    finally:
        await run_in_threadpool(incoming.discard)
    return Upload(sha256=actual, size=incoming.size, checked=checked, published=published)
