"""How many artifact bytes this API process moved (docs/storage.md): request bodies it
received and response bodies it sent on the artifact routes (datasets, code, weights,
models, outputs, checkpoints), JSON excepted. With object storage, clients move those
bytes themselves and both counts stay 0 for them; ``GET /v1/storage`` shows the counts."""

from __future__ import annotations

import re
import threading
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_ARTIFACT_ROUTE = re.compile(
    r"^/v1/(worker/)?(datasets|code|weights)(/|$)|^/v1/(worker/)?jobs/[^/]+/(model|outputs|checkpoint)(/|$)"
)
_NOT_ARTIFACT_TYPES = (b"application/json", b"text/event-stream", b"application/problem+json")


class ArtifactTraffic:
    """Bytes in and out of this process on the artifact routes, since it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received = 0
        self.sent = 0

    def add(self, *, received: int = 0, sent: int = 0) -> None:
        with self._lock:
            self.received += received
            self.sent += sent


TRAFFIC = ArtifactTraffic()


def _content_type(headers: Any) -> bytes:
    for name, value in headers:
        if name.lower() == b"content-type":
            return bytes(value).split(b";")[0].strip().lower()
    return b""


class ArtifactTrafficMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _ARTIFACT_ROUTE.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        counts_in = _content_type(scope.get("headers", ())) not in _NOT_ARTIFACT_TYPES
        counts_out = False

        async def counting_receive() -> Message:
            message = await receive()
            if counts_in and message["type"] == "http.request":
                TRAFFIC.add(received=len(message.get("body", b"")))
            return message

        async def counting_send(message: Message) -> None:
            nonlocal counts_out
            if message["type"] == "http.response.start":
                counts_out = _content_type(message.get("headers", ())) not in _NOT_ARTIFACT_TYPES
            elif message["type"] == "http.response.body" and counts_out:
                TRAFFIC.add(sent=len(message.get("body", b"")))
            await send(message)

        await self.app(scope, counting_receive, counting_send)
