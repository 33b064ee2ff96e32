"""Open streams end when their token is revoked or their user disabled.

A follower authenticates once, when its stream opens; a revoked token, a disabled user or a
web session signed out (docs/oidc.md) must not keep an open ``logs?follow=true`` body or a
job's events flowing. :func:`while_token_valid` passes a stream through and checks the token
every ``interval`` seconds (while items flow and while it waits for one): once it is revoked
or gone, the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from service.db.engine import Database
from service.db.models import Token, User
from service.services.tokens import Principal
from service.services.web_sessions import session_live

T = TypeVar("T")
TOKEN_CHECK_INTERVAL_S = 1.0


def token_valid(db: Database, principal: Principal) -> bool:
    with db.read_session() as session:
        token = session.get(Token, principal.id)
        if token is None or token.revoked_at is not None:
            return False
        if principal.session_id is not None and not session_live(session, principal.session_id):
            return False
        if principal.user_id is not None:
            return session.scalar(select(User.disabled_at).where(User.id == principal.user_id)) is None
        return True


async def while_token_valid(
    db: Database, principal: Principal, body: AsyncIterator[T], interval: float = TOKEN_CHECK_INTERVAL_S
) -> AsyncIterator[T]:
    """The items of ``body`` until it ends or ``principal``'s token is revoked."""
    items = aiter(body)
    pending: asyncio.Future[T] | None = None
    checked = time.monotonic()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            wait = max(0.0, checked + interval - time.monotonic())
            done, _ = await asyncio.wait({pending}, timeout=wait)
            if pending in done:
                try:
                    item = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield item
            if time.monotonic() >= checked + interval:
                if not await run_in_threadpool(token_valid, db, principal):
                    return
                checked = time.monotonic()
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        closer = getattr(items, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()
