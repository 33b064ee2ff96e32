"""The route class every router uses: sync endpoints give their sessions back as they return.

A sync endpoint runs in the threadpool, and FastAPI then validates its return value in
*another* threadpool call, while a ``yield`` dependency's session is closed only after
that. Under a burst of requests every pool thread can end up waiting for a database
connection that is held by a finished endpoint whose response is itself waiting for a
thread: nothing moves until the pool's timeout, and the waiting requests fail. Closing
the endpoint's sessions in the endpoint's own thread, the moment it returns, breaks that
cycle: a connection is never held across a wait for a thread.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session

from service.api.errors import surrogate_field, surrogate_message


def release_sessions(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a sync endpoint so the sessions it was given are closed when it returns.

    Async endpoints are left alone: they run on the event loop and their responses are
    serialized there, so they never wait for a thread while holding a connection.
    Whatever the endpoint returns must not need its session any more (routes return
    pydantic models or responses built from loaded rows).
    """
    if inspect.iscoroutinefunction(endpoint) or inspect.isasyncgenfunction(endpoint):
        return endpoint

    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    return run


class UnicodeCheckedRequest(Request):
    """A request whose JSON body is refused (422 ``ValidationError``) when its text is not
    Unicode: a lone UTF-16 surrogate (``"\\ud800"``) is valid JSON, but neither the
    database drivers nor a JSON response can encode it."""

    async def json(self) -> Any:
        value = await super().json()
        found = surrogate_field(value)
        if found is not None:
            # FastAPI passes an HTTPException raised while it reads a body on unchanged.
            raise HTTPException(422, surrogate_message(*found))
        return value


class SessionScopedRoute(APIRoute):
    """An APIRoute whose sync endpoint releases its database sessions as it returns, and
    whose JSON bodies are checked to be Unicode text."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, release_sessions(endpoint), **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if not isinstance(request, UnicodeCheckedRequest):
                request = UnicodeCheckedRequest(request.scope, request.receive)
            return await handler(request)

        return checked
