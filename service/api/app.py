"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.api.docs import install_docs
from service.api.errors import install_error_handlers
from service.api.routes import (
    artifacts,
    cluster,
    datasets,
    health,
    jobs,
    logs,
    reports,
    streams,
    tokens,
    workers,
)
from service.api.routes.ui import install_ui
from service.api.security import SecurityHeadersMiddleware
from service.config import Settings, get_settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.services.datasets import sweep_staging_periodically
from service.services.reaper import run_reaper
from service.services.tokens import ensure_bootstrap_token
from service.services.wakeup import Wakeup
from service.states import Role

log = logging.getLogger(__name__)


def bootstrap(settings: Settings) -> Database:
    """Prepare the data directory and database: migrations, then the first admin token."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.sqlalchemy_url)
    db = Database(settings.sqlalchemy_url)
    with db.transaction() as session:
        ensure_bootstrap_token(session, settings.admin_token_path, Role.ADMIN, "admin")
    return db


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.db = bootstrap(settings)
        # Expired leases, lost nodes, settled cancellations and scheduling passes.
        stop_reaper = asyncio.Event()
        reaper = asyncio.create_task(run_reaper(app.state.db, settings, app.state.wakeup, stop_reaper))
        # What uploads interrupted by a crash left in the staging folder.
        sweeper = asyncio.create_task(sweep_staging_periodically(settings, stop_reaper))
        try:
            yield
        finally:
            stop_reaper.set()
            await reaper
            await sweeper
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
    app.state.wakeup = Wakeup()
    install_error_handlers(app)
    install_docs(app)
    app.include_router(streams.list_router)
    for module in (health, tokens, jobs, datasets, cluster, workers, reports, logs, artifacts, streams):
        app.include_router(module.router)
    app.include_router(tokens.whoami_router)
    install_ui(app)
    app.add_middleware(SecurityHeadersMiddleware)
    return app
