"""``GET /metrics``: the replica's Prometheus metrics (docs/operations.md, "Prometheus and
Grafana"), and the middleware that times every request by its route's path template.

Who may scrape: with ``TORCHYARD_METRICS_TOKEN`` set, whoever sends it as a bearer token
(401 otherwise); unset, the addresses of ``TORCHYARD_METRICS_ALLOW`` (loopback by default)
without a token, and nobody else (403).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import time
from collections.abc import Iterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.routing import SessionScopedRoute
from service.api.traffic import TRAFFIC
from service.config import Settings
from service.services.metrics import REQUEST_DURATION, UNMATCHED_ROUTE, method_label
from service.services.metrics_collector import DatabaseCollector
from torchyard.contract.errors import AuthenticationError, PermissionDeniedError

router = APIRouter(tags=["operations"], route_class=SessionScopedRoute)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "content": {CONTENT_TYPE_PLAIN_0_0_4: {}, "application/openmetrics-text": {}},
            "description": "Prometheus's text format, or OpenMetrics where the scraper asks for it",
        },
        401: {"description": "TORCHYARD_METRICS_TOKEN is set and the request did not send it"},
        403: {"description": "no token is set and the client is outside TORCHYARD_METRICS_ALLOW"},
    },
)
def metrics(request: Request) -> Response:
    """This replica's metrics in Prometheus's text format (docs/operations.md): event
    counters and histograms of this process, and gauges read from the database."""
    check_scrape(request.app.state.settings, request.headers.get("authorization"), _client(request))
    registry: CollectorRegistry = request.app.state.metrics_registry
    # The format the scraper asks for (OpenMetrics for Prometheus), else the classic text.
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(registry), headers={"Content-Type": content_type})


def _client(request: Request) -> str | None:
    return request.client.host if request.client else None


def check_scrape(settings: Settings, authorization: str | None, client: str | None) -> None:
    """Raise unless this scrape may read the metrics (see the module's docstring)."""
    if settings.metrics_token:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), settings.metrics_token.encode()
        ):
            raise AuthenticationError("GET /metrics needs the scrape token: Authorization: Bearer <it>")
        return
    if not client_allowed(client, tuple(filter(None, settings.metrics_allow.split(",")))):
        raise PermissionDeniedError(
            "GET /metrics answers only TORCHYARD_METRICS_ALLOW's networks (loopback by default) "
            "while TORCHYARD_METRICS_TOKEN is unset"
        )


@functools.lru_cache(maxsize=1024)
def client_allowed(client: str | None, networks: tuple[str, ...]) -> bool:
    """Whether ``client`` (an IP address) is in one of ``networks`` (CIDR)."""
    if not client:
        return False
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in ipaddress.ip_network(n, strict=False) for n in networks)


class _Process(Collector):
    """The process-wide metrics (counters and histograms of the events, the process's own)."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


class _Traffic(Collector):
    """The artifact bytes this process moved (service.api.traffic)."""

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "torchyard_api_artifact_bytes",
            "Artifact bytes this API process received (in) and sent (out) on the artifact routes "
            "(with object storage, clients move them directly and these stay 0).",
            labels=["direction"],
        )
        family.add_metric(["in"], TRAFFIC.received)
        family.add_metric(["out"], TRAFFIC.sent)
        yield family


def install_metrics(app: FastAPI) -> None:
    """``GET /metrics`` and the request timing. The database's gauges are registered once the
    app has its database (:func:`attach_database`)."""
    app.state.metrics_registry = CollectorRegistry(auto_describe=False)
    app.state.metrics_registry.register(_Process())
    app.state.metrics_registry.register(_Traffic())
    app.include_router(router)
    app.add_middleware(RequestTimingMiddleware)


def attach_database(app: FastAPI, collector: DatabaseCollector) -> None:
    app.state.metrics_registry.register(collector)


def route_label(route: BaseRoute | None) -> str:
    """A request's ``route`` label: its route's path template (``/v1/jobs/{job_id}``), never
    the path it was sent to; ``unmatched`` when no route took it."""
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED_ROUTE


class RequestTimingMiddleware:
    """Times each HTTP request until its response's last byte, labelled by method, route
    template and status (``torchyard_http_request_duration_seconds``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            REQUEST_DURATION.labels(
                method_label(scope.get("method", "")), route_label(scope.get("route")), str(status)
            ).observe(time.perf_counter() - start)
