"""The job API end to end over real HTTP: uvicorn on a loopback port, driven with httpx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id


@pytest.fixture
def live_server(make_settings: Any) -> Iterator[LiveServer]:
    # Two nodes allowed but one registered (and no agent heartbeating it, so a long lease):
    # the 2-node jobs below are valid but cannot be placed, so they stay queued.
    server = LiveServer(make_settings(max_nodes=2, lease_timeout_s=600)).start()
    yield server
    server.stop()


@pytest.mark.both_databases
def test_submit_get_list_filter_paginate_cancel(live_server: LiveServer) -> None:
    settings = live_server.settings
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60) as admin:
        assert httpx.get(f"{live_server.url}/healthz").json() == {"status": "ok"}
        user = create_token(admin, "user", "carol")
        uid = token_id(admin, user)
        register_node(admin, create_token(admin, "worker"), "gpu-1", units=8)
    train, val = insert_dataset(settings, uid), insert_dataset(settings, uid)
    with httpx.Client(base_url=live_server.url, headers=auth(user), timeout=60) as c:
        ids = []
        for i in range(5):
            r = c.post(
                "/v1/jobs",
                json=job_spec(
                    train,
                    val,
                    name=f"job-{i}",
                    parameters={"epochs": i + 1},
                    resources={"node_count": 2},
                ),
            )
            assert r.status_code == 201, r.text
            assert r.headers["content-type"] == "application/json"
            ids.append(r.json()["id"])
        one = c.get(f"/v1/jobs/{ids[0]}").json()
        assert one["name"] == "job-0"
        assert one["parameters"]["epochs"] == 1
        assert one["failure"] is None
        assert one["created_at"].endswith(("Z", "+00:00"))

        page1 = c.get("/v1/jobs", params={"limit": 2}).json()
        assert [j["id"] for j in page1["items"]] == ids[::-1][:2]
        page2 = c.get("/v1/jobs", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
        page3 = c.get("/v1/jobs", params={"limit": 2, "cursor": page2["next_cursor"]}).json()
        assert [j["id"] for j in page2["items"] + page3["items"]] == ids[::-1][2:]
        assert page3["next_cursor"] is None

        queued = {j["id"] for j in c.get("/v1/jobs", params={"status": "queued"}).json()["items"]}
        assert queued == set(ids)
        # The scheduler (at submission or its next pass) says why the job waits.
        deadline = time.monotonic() + 10
        while not (reason := c.get(f"/v1/jobs/{ids[0]}").json()["reason"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reason is not None
        assert "waiting for 2 ready nodes" in reason
        # Cancel is idempotent; a queued job is cancelled at once.
        target = ids[2]
        first = c.post(f"/v1/jobs/{target}/cancel").json()
        second = c.post(f"/v1/jobs/{target}/cancel").json()
        assert first["status"] == second["status"] == "cancelled"
        assert first["finished_at"] == second["finished_at"]
        assert [h["status"] for h in second["history"]] == ["queued", "cancelled"]
        cancelled = c.get("/v1/jobs", params={"status": "cancelled"}).json()["items"]
        assert [j["id"] for j in cancelled] == [target]
        both = c.get("/v1/jobs", params=[("status", "cancelled"), ("status", "queued")]).json()["items"]
        assert target in {j["id"] for j in both}
        assert c.get("/v1/jobs/does-not-exist").status_code == 404
        r = c.post(f"/v1/jobs/{ids[1]}/cancel", json={"unexpected": 1})
        assert r.status_code in (200, 422)
