"""Fixtures the CLI tests share."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import LiveServer
from tests.support.factories import auth, create_token
from tests.support.fake_agent import FakeAgent


@pytest.fixture
def agent(live_server: LiveServer) -> Iterator[FakeAgent]:
    """A scripted worker of the live server (no training: it answers as a node would)."""
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
        worker = create_token(admin, "worker")
    a = FakeAgent(live_server.url, worker)
    yield a
    a.close()
