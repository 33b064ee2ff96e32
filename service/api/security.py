"""Browser-facing protections: response headers on every answer, the sign-in cookie, and
the CSRF rule for requests authenticated by that cookie.

The web UI signs in by sending a token once to ``POST /v1/session``; the answer sets it in
an HttpOnly, SameSite=Strict cookie that page scripts cannot read. A request that carries
no ``Authorization`` header is authenticated by that cookie, and then a write (any method
but GET, HEAD and OPTIONS) must also carry the :data:`CSRF_HEADER`: a page of another
origin cannot add a custom header without a CORS preflight, which this service never
grants.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SESSION_COOKIE = "torchyard_session"
CSRF_HEADER = "X-Torchyard-CSRF"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# The UI and every API answer: scripts, styles, images and connections from this origin
# only, no inline script or style, never framed.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
# Swagger UI and ReDoc: scripts of this origin only (no inline script); their inline styles
# and ReDoc's web worker are allowed.
DOCS_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; worker-src 'self' blob:; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
_DOCS_PATHS = ("/docs", "/redoc")

_COMMON = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


def policy_for(path: str) -> str:
    if path in _DOCS_PATHS:
        return DOCS_POLICY
    return CONTENT_SECURITY_POLICY


class SecurityHeadersMiddleware:
    """Adds the headers above to every HTTP response (a plain ASGI middleware, so streamed
    bodies are passed through untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = [*_COMMON, (b"content-security-policy", policy_for(scope.get("path", "")).encode())]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers.extend((name, value) for name, value in extra if name not in present)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
