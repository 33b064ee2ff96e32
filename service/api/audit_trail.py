"""The audit trail's recorder (docs/audit.md): every user or admin write, with its answer.

:data:`AUDITED` maps each writing route (method and path template) to the action it is in
the trail, the kind of its target, where the target's id comes from (a path parameter, or
the answer: a new job's id) and which fields of the request are worth keeping. It is the one
place to extend when a route is added; ``tests/service/test_audit.py`` fails for a writing
route that is in neither :data:`AUDITED` nor :data:`NOT_AUDITED`.

:class:`AuditMiddleware` records once the route is done with the request (so a refused
request is recorded with its 4xx too), in a short transaction of its own, after the route's
own sessions are closed. The routes of the worker protocol (``/v1/worker/...``: registrations,
heartbeats, claims, reports, uploads by agents) are not recorded: they are no one's change,
and what they do to a job is in the job's history.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.services import audit
from service.services.tokens import Principal

# Where a target's id comes from: the path parameters, the request's JSON and the answer's.
Json = dict[str, Any] | None
TargetOf = Callable[[Mapping[str, Any], Json, Json], str | None]

# Bodies read for the trail: JSON only, and only this much of it (an upload is not JSON).
_CAPTURE_BYTES = 64 * 1024
WORKER_PREFIX = "/v1/worker/"
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def param(name: str) -> TargetOf:
    """The target is the path parameter ``name``."""
    return lambda params, _body, _answer: _text(params.get(name))


def answer(name: str) -> TargetOf:
    """The target is the answer's field ``name`` (a new row's id)."""
    return lambda _params, _body, reply: _text((reply or {}).get(name))


def _model_version(params: Mapping[str, Any], _body: Json, reply: Json) -> str | None:
    """``name:version`` of the answer (a ``latest`` in the path resolved), else of the path."""
    if reply and reply.get("name") is not None and reply.get("version") is not None:
        return f"{reply['name']}:{reply['version']}"
    if params.get("name") is not None:
        return f"{params['name']}:{params.get('version')}"
    return None


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True)
class Audited:
    """How one writing route is recorded.

    ``fields``: the request's JSON fields kept in the details (None: all of them; always
    cleaned of secrets and cut small by :func:`service.services.audit.clean_details`).
    ``answer_fields``: fields of the answer kept too (never a secret one: a token's value, a
    webhook's secret). Path parameters that are not the target are kept as well."""

    action: str
    kind: str
    target: TargetOf
    fields: tuple[str, ...] | None = ()
    answer_fields: tuple[str, ...] = ()


_JOB_FIELDS = (
    "type",
    "name",
    "team",
    "priority",
    "model",
    "train_dataset",
    "validation_dataset",
    "resources",
    "distribution",
)
_PLAN_FIELDS = ("name", "size", "sha256")

AUDITED: dict[tuple[str, str], Audited] = {
    # Signing in and out of the web UI (OpenID Connect's sign-ins call audit.record).
    ("POST", "/v1/session"): Audited("auth.sign_in", "token", answer("id")),
    ("DELETE", "/v1/session"): Audited("auth.sign_out", "token", lambda *_: None),
    ("POST", "/auth/logout"): Audited("auth.sign_out", "user", lambda *_: None),
    # Tokens, users and teams.
    ("POST", "/v1/tokens"): Audited("token.create", "token", answer("id"), ("name", "role", "user")),
    ("DELETE", "/v1/tokens/{token_id}"): Audited("token.revoke", "token", param("token_id")),
    ("POST", "/v1/users"): Audited("user.create", "user", answer("name"), None),
    ("PATCH", "/v1/users/{name}"): Audited("user.update", "user", param("name"), None),
    ("POST", "/v1/teams"): Audited("team.create", "team", answer("name"), None),
    ("PATCH", "/v1/teams/{name}"): Audited("team.update", "team", param("name"), None),
    # Jobs and sweeps.
    ("POST", "/v1/jobs"): Audited("job.submit", "job", answer("id"), _JOB_FIELDS),
    ("PATCH", "/v1/jobs/{job_id}"): Audited("job.update", "job", param("job_id"), None),
    ("POST", "/v1/jobs/{job_id}/cancel"): Audited("job.cancel", "job", param("job_id")),
    ("DELETE", "/v1/jobs/{job_id}"): Audited("job.delete", "job", param("job_id")),
    ("POST", "/v1/jobs/{job_id}/clone"): Audited("job.clone", "job", answer("id"), None),
    ("POST", "/v1/sweeps"): Audited(
        "sweep.create", "sweep", answer("id"), ("name", "team", "algorithm", "objective", "search_space")
    ),
    ("POST", "/v1/sweeps/{sweep_id}/cancel"): Audited("sweep.cancel", "sweep", param("sweep_id")),
    # Models.
    ("POST", "/v1/models"): Audited("model.register", "model", _model_version, ("name", "job_id", "path")),
    ("DELETE", "/v1/models/{name}/versions/{version}"): Audited("model.delete", "model", _model_version),
    # Datasets, code packages and pretrained weights (a direct upload: planned, then completed).
    ("POST", "/v1/datasets"): Audited(
        "dataset.create", "dataset", answer("id"), ("name", "path", "sample"), ("name",)
    ),
    ("POST", "/v1/datasets/uploads"): Audited(
        "dataset.upload", "upload", answer("upload_id"), _PLAN_FIELDS, ("mode",)
    ),
    ("POST", "/v1/datasets/uploads/{upload_id}"): Audited(
        "dataset.create", "dataset", answer("id"), (), ("name",)
    ),
    ("DELETE", "/v1/datasets/{dataset_id}"): Audited("dataset.delete", "dataset", param("dataset_id")),
    ("POST", "/v1/code"): Audited("code.create", "code", answer("id"), ("name",), ("name",)),
    ("POST", "/v1/code/uploads"): Audited(
        "code.upload", "upload", answer("upload_id"), _PLAN_FIELDS, ("mode",)
    ),
    ("POST", "/v1/code/uploads/{upload_id}"): Audited("code.create", "code", answer("id"), (), ("name",)),
    ("DELETE", "/v1/code/{code_id}"): Audited("code.delete", "code", param("code_id")),
    ("POST", "/v1/weights"): Audited("weights.create", "weights", answer("id"), ("name",), ("name",)),
    ("POST", "/v1/weights/uploads"): Audited(
        "weights.upload", "upload", answer("upload_id"), _PLAN_FIELDS, ("mode",)
    ),
    ("POST", "/v1/weights/uploads/{upload_id}"): Audited(
        "weights.create", "weights", answer("id"), (), ("name",)
    ),
    ("DELETE", "/v1/weights/{weights_id}"): Audited("weights.delete", "weights", param("weights_id")),
    # The cluster and webhooks.
    ("POST", "/v1/cluster/nodes/{node}/drain"): Audited("node.drain", "node", param("node")),
    ("POST", "/v1/cluster/nodes/{node}/undrain"): Audited("node.undrain", "node", param("node")),
    ("POST", "/v1/webhooks"): Audited("webhook.create", "webhook", answer("id"), ("url", "events")),
    ("DELETE", "/v1/webhooks/{webhook_id}"): Audited("webhook.delete", "webhook", param("webhook_id")),
}

# Writing routes that change nothing of anyone's: not recorded (with why).
NOT_AUDITED: dict[tuple[str, str], str] = {
    ("POST", "/v1/models/{name}/versions/{version}/predict"): "a prediction reads the model, changes nothing",
}


def audited_route(method: str, path: str) -> Audited | bool | None:
    """How a request to the route ``path`` (its template) is recorded: its entry, None for a
    writing route recorded generically (one missing from :data:`AUDITED`), False for one
    not recorded at all (reads, the worker protocol, :data:`NOT_AUDITED`)."""
    if method not in WRITE_METHODS or path.startswith(WORKER_PREFIX) or (method, path) in NOT_AUDITED:
        return False
    return AUDITED.get((method, path))


def _json_of(chunks: list[bytes], size: int) -> Json:
    """The captured body as a JSON object, or None (not JSON, not an object, cut short)."""
    if not chunks or size > _CAPTURE_BYTES:
        return None
    try:
        value = json.loads(b"".join(chunks))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def _is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


def _via(scope: Scope, principal: Principal | None) -> str:
    if principal is None:
        return audit.VIA_NONE
    return audit.VIA_TOKEN if _header(scope, b"authorization") else audit.VIA_SESSION


def details_of(
    entry: Audited | None,
    scope: Scope,
    params: Mapping[str, Any],
    body: Json,
    reply: Json,
    target: str | None,
) -> dict[str, Any]:
    """What the trail keeps of a request: chosen fields of its JSON and of the answer, and
    the path parameters that are not its target (a clone's source job)."""
    details: dict[str, Any] = {}
    if entry is None:
        details["method"] = scope.get("method")
        details["route"] = getattr(scope.get("route"), "path", None)
    elif body is not None:
        names = list(body) if entry.fields is None else [n for n in entry.fields if n in body]
        details.update({name: body[name] for name in names})
    if entry is not None and reply is not None:
        details.update({name: reply[name] for name in entry.answer_fields if name in reply})
    if entry is None or entry.target is not _model_version:
        details.update({name: value for name, value in params.items() if str(value) != target})
    return details


class _Capture:
    """The start of a JSON body passing by (a request's or an answer's), up to
    :data:`_CAPTURE_BYTES`."""

    def __init__(self, wanted: bool) -> None:
        self.wanted = wanted
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        if self.wanted:
            self.size += len(chunk)
            if self.size <= _CAPTURE_BYTES:
                self.chunks.append(chunk)

    def json(self) -> Json:
        return _json_of(self.chunks, self.size)


class AuditMiddleware:
    """Records each user or admin write in the audit trail (see the module's docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in WRITE_METHODS:
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})
        request = _Capture(_is_json(_header(scope, b"content-type")))
        reply = _Capture(False)
        status = 500

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                request.add(message.get("body", b""))
            return message

        async def send_recorded(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = {k.lower(): v for k, v in message.get("headers", ())}
                reply.wanted = _is_json(headers.get(b"content-type", b"").decode("latin-1"))
            elif message["type"] == "http.response.body":
                reply.add(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive_body, send_recorded)
        finally:
            # Once the route is done with its own sessions: on SQLite a write transaction the
            # route still held (an async route's session closes after its answer) would make
            # this one wait on the database's lock.
            await self._record(scope, status, request.json(), reply.json())

    async def _record(self, scope: Scope, status: int, body: Json, reply: Json) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None)
        if not isinstance(path, str):
            return  # no route took it: nothing was changed
        entry = audited_route(str(scope.get("method")), path)
        if entry is False:
            return
        assert entry is None or isinstance(entry, Audited)
        principal = scope.get("state", {}).get("principal")
        if not isinstance(principal, Principal):
            principal = None
        params = scope.get("path_params") or {}
        client = scope.get("client")
        target = entry.target(params, body, reply) if entry is not None else None
        await run_in_threadpool(
            audit.record,
            scope["app"].state.db,
            action=entry.action if entry is not None else "request",
            outcome=status,
            actor=principal,
            via=_via(scope, principal),
            source=str(client[0]) if client else None,
            target_kind=entry.kind if entry is not None else None,
            target_id=target,
            details=details_of(entry, scope, params, body, reply, target),
        )
