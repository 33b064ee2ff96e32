"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from sqlalchemy.engine import make_url
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from service.api.audit_trail import AuditMiddleware
from service.api.docs import install_docs
from service.api.errors import install_error_handlers
from service.api.metrics import attach_database, install_metrics
from service.api.routes import (
    artifacts,
    audit,
    checkpoints,
    cluster,
    code,
    datasets,
    health,
    jobs,
    logs,
    models,
    oidc,
    outputs,
    reports,
    storage,
    streams,
    sweeps,
    teams,
    tokens,
    webhooks,
    weights,
    workers,
)
from service.api.routes.ui import install_ui
from service.api.routes.workers import Lanes
from service.api.security import SecurityHeadersMiddleware
from service.api.traffic import ArtifactTrafficMiddleware
from service.config import Settings, get_settings
from service.db.engine import Database, is_unavailable, postgres_connect_args
from service.db.migrate import upgrade
from service.engines import make_driver
from service.services.datasets import clean_staging_periodically
from service.services.metrics_collector import DatabaseCollector
from service.services.node_timing import NodeTiming
from service.services.oidc import OidcProvider
from service.services.reconciler import Reconciler
from service.services.scheduler_loop import SchedulerLoop
from service.services.tokens import ensure_bootstrap_token
from service.services.upkeep.listening import ListeningClock
from service.services.upkeep.reaper import run_reaper
from service.services.wakeup import PlacementListener, Wakeup
from service.services.webhook_delivery import run_deliveries
from service.states import Role

log = logging.getLogger(__name__)


def open_database(settings: Settings) -> Database:
    """The service's database handle, with the timeouts of ``settings``."""
    return Database(
        settings.sqlalchemy_url,
        connect_timeout_s=settings.database_connect_timeout_s,
        statement_timeout_s=settings.database_statement_timeout_s,
        pool_timeout_s=settings.database_pool_timeout_s,
    )


def bootstrap(settings: Settings) -> Database:
    """Prepare the data directory and database: migrations, then the first admin token.

    An unreachable database (PostgreSQL restarting beside the API) is waited for, with
    backoff, up to ``database_wait_s``; then the last error is raised."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    protect_sqlite_file(settings.sqlalchemy_url)
    deadline = time.monotonic() + settings.database_wait_s
    delay = 0.5
    while True:
        try:
            upgrade(settings.sqlalchemy_url)
            db = open_database(settings)
            with db.transaction() as session:
                ensure_bootstrap_token(session, settings.admin_token_path, Role.ADMIN, "admin")
            return db
        except Exception as exc:
            if not is_unavailable(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning("the database is unreachable (%s); retrying in %.1f s", _first_line(exc), delay)
            time.sleep(delay)
            # At most a second apart: the API serves again within a second of its database.
            delay = min(delay * 2, 1.0)


def protect_sqlite_file(url: str) -> None:
    """A SQLite database (and its journal files) readable by its owner only (0600): created
    so before SQLite opens it, and made so when an older start left it 0644."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("sqlite") or parsed.database in (None, "", ":memory:"):
        return
    path = Path(parsed.database)
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(OSError):
            os.chmod(f"{path}{suffix}", 0o600)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


_schemas: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
_schemas_lock = threading.Lock()


def _build_openapi(app: FastAPI) -> None:
    """Build the app's OpenAPI schema, or reuse the one an app with the same routes built.

    Every app this factory makes has the same routes, so a process that makes several (a
    test session, a process serving more than one) builds the schema once (~0.2 s each)."""
    key = tuple(
        sorted(
            (getattr(r, "path", ""), ",".join(sorted(getattr(r, "methods", None) or ()))) for r in app.routes
        )
    )
    with _schemas_lock:
        cached = _schemas.get(key)
        if cached is None:
            cached = _schemas[key] = app.openapi()
    if app.openapi_schema is None:
        app.openapi_schema = copy.deepcopy(cached)


# Middle-generation collections between two full ones in a serving process (Python: 10).
GC_FULL_EVERY = 100


def freeze_heap() -> None:
    """Leave what start-up made out of the garbage collector's full collections.

    A started API process holds a few hundred thousand long-lived objects (the modules of
    FastAPI, pydantic and SQLAlchemy, the routes, the OpenAPI schema). Python's full
    collection walks every one of them: 180-290 ms with the GIL held, every 10-15 s in an
    API process answering 1,000 nodes, during which no request of that process moves (the
    slowest heartbeats and submissions of ``bench/bench_scale.py``). Frozen after start-up
    (``gc.freeze``), they are skipped. What the process comes to hold after start-up (a
    connection and a parked claim for each node) still took 80-130 ms a full collection at
    1,000 nodes, so full collections also come :data:`GC_FULL_EVERY` middle ones apart
    instead of 10: every minute or two instead of every few seconds. The young and middle
    collections (a few milliseconds) keep their pace, and cyclic garbage is still
    collected."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, GC_FULL_EVERY)


def create_app(settings: Settings | None = None, *, freeze: bool = False) -> FastAPI:
    """The app. ``freeze``: once started, freeze the heap (:func:`freeze_heap`): for a
    process that serves, not for one that makes many apps (the tests)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.db = await asyncio.to_thread(bootstrap, settings)
        # GET /metrics: the gauges read from the database (docs/operations.md).
        attach_database(app, DatabaseCollector(app.state.db, app.state.timing.settings))
        app.state.lanes = Lanes()
        # The OpenAPI schema is built once, now: the web UI reads it on every page load.
        await asyncio.to_thread(_build_openapi, app)
        # Nodes are judged lost only after a full lease period of this replica listening.
        app.state.listening = ListeningClock()
        # Scheduling passes, one at a time, out of the request path.
        # What runs the jobs (docs/slurm.md): torchyard's agents, or an existing Slurm cluster.
        engine = Reconciler(make_driver(settings))
        await asyncio.to_thread(engine.start)
        app.state.engine = engine
        app.state.scheduling = SchedulerLoop(
            app.state.db, settings, app.state.wakeup, engine, app.state.timing
        ).start()
        # The heartbeat interval and lease handed to nodes follow the cluster's size.
        await asyncio.to_thread(app.state.timing.refresh, app.state.db)
        # PostgreSQL: work placed by any replica wakes the claims parked here.
        listener = None
        if not app.state.db.is_sqlite:
            listener = PlacementListener(
                settings.sqlalchemy_url,
                app.state.wakeup,
                postgres_connect_args(settings.database_connect_timeout_s, 0),
            )
            listener.start()
        # Expired leases, lost nodes, settled cancellations and scheduling passes.
        stop_reaper = asyncio.Event()
        reaper = asyncio.create_task(
            run_reaper(
                app.state.db,
                settings,
                app.state.wakeup,
                stop_reaper,
                app.state.listening,
                app.state.scheduling,
                app.state.timing,
            )
        )
        # What uploads interrupted by a crash left in the staging folder.
        staging_cleaner = asyncio.create_task(clean_staging_periodically(settings, stop_reaper))
        # Webhook deliveries due, from any replica's outbox rows (docs/webhooks.md).
        deliveries = asyncio.create_task(run_deliveries(app.state.db, settings, stop_reaper))
        if freeze:
            freeze_heap()
        try:
            yield
        finally:
            stop_reaper.set()
            await reaper
            await staging_cleaner
            await deliveries
            await asyncio.to_thread(app.state.scheduling.stop)
            if listener is not None:
                await asyncio.to_thread(listener.stop)
            pool = getattr(app.state, "scoring_pool", None)
            if pool is not None:
                pool.close()
            app.state.db.dispose()

    app = FastAPI(
        title="torchyard",
        version="1",
        description="Train PyTorch image classifiers on a cluster.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    # Sign-in with the organisation's OpenID provider (docs/oidc.md); its documents are read
    # at first use, so a provider that is down does not keep the API from starting.
    app.state.oidc = OidcProvider(settings) if settings.oidc_issuer else None
    app.state.timing = NodeTiming(settings)
    app.state.wakeup = Wakeup()
    install_error_handlers(app)
    install_docs(app)
    app.include_router(streams.list_router)
    for module in (
        health,
        tokens,
        jobs,
        datasets,
        code,
        cluster,
        workers,
        reports,
        logs,
        artifacts,
        models,
        checkpoints,
        outputs,
        streams,
        sweeps,
        weights,
        storage,
        teams,
        webhooks,
        audit,
        oidc,
    ):
        app.include_router(module.router)
    app.include_router(tokens.whoami_router)
    install_ui(app)
    # Every user or admin write recorded in the audit trail, with its answer's status.
    app.add_middleware(AuditMiddleware)
    app.add_middleware(SecurityHeadersMiddleware)
    app.add_middleware(ArtifactTrafficMiddleware)
    # GET /metrics, and every request timed by its route (outermost: the others' time counts).
    install_metrics(app)
    # The client's address (the audit trail's, /metrics' allowed networks) and scheme from
    # X-Forwarded-For/-Proto, only when the peer is one of TORCHYARD_TRUSTED_PROXIES.
    if settings.trusted_proxy_networks:
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.trusted_proxy_networks)
    return app
