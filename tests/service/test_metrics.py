"""``GET /metrics`` without Prometheus: who may scrape, bounded labels, counting on commit
(tests/service/test_prometheus.py scrapes it with a real Prometheus)."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.api.app import create_app
from service.api.metrics import check_scrape, client_allowed
from service.config import Settings
from service.db.engine import Database
from service.services.metrics import (
    MAX_LABEL_LENGTH,
    REQUEST_DURATION,
    count_on_commit,
    failure_code_label,
    job_team_label,
    method_label,
    node_pool,
)
from torchyard.contract.errors import AuthenticationError, PermissionDeniedError

TOKEN = "a-scrape-token-of-the-tests"


def test_with_a_token_set_only_its_bearer_may_scrape_from_anywhere(make_settings: Any) -> None:
    settings = make_settings(metrics_token=TOKEN)
    check_scrape(settings, f"Bearer {TOKEN}", "203.0.113.9")
    check_scrape(settings, f"bearer {TOKEN}", None)
    for header in (None, "", TOKEN, f"Basic {TOKEN}", "Bearer wrong", f"Bearer {TOKEN}x"):
        with pytest.raises(AuthenticationError):
            check_scrape(settings, header, "127.0.0.1")


def test_without_a_token_only_the_allowed_networks_may_scrape(make_settings: Any) -> None:
    default = make_settings()
    for client in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"):
        check_scrape(default, None, client)
    for client in ("10.0.0.1", "203.0.113.9", "::ffff:10.0.0.1", "testclient", None):
        with pytest.raises(PermissionDeniedError):
            check_scrape(default, None, client)
    lan = make_settings(metrics_allow="10.0.0.0/8, 192.168.1.7")
    check_scrape(lan, None, "10.20.30.40")
    check_scrape(lan, None, "192.168.1.7")
    for client in ("127.0.0.1", "192.168.1.8"):
        with pytest.raises(PermissionDeniedError):
            check_scrape(lan, None, client)
    assert not client_allowed("not an address", ("0.0.0.0/0",))


def test_scrape_settings_are_checked(make_settings: Any) -> None:
    with pytest.raises(ValidationError, match="TORCHYARD_METRICS_ALLOW"):
        make_settings(metrics_allow="10.0.0.0/8,somewhere")
    with pytest.raises(ValidationError, match="at least 16"):
        make_settings(metrics_token="short")
    assert make_settings(metrics_allow=" 10.1.2.3/16 ,::1").metrics_allow == "10.1.0.0/16,::1/128"
    assert make_settings(metrics_allow="").metrics_allow == ""  # nobody without a token
    assert "metrics_token" not in repr(make_settings(metrics_token=TOKEN))


def test_labels_are_bounded() -> None:
    assert job_team_label() == "default"
    assert job_team_label("vision") == "vision"
    assert len(job_team_label("t" * 500)) == MAX_LABEL_LENGTH
    assert node_pool("agents", {"partitions": ["gpu"]}) == "default"
    assert node_pool("slurm", {"partitions": ["gpu", "debug"]}) == "debug,gpu"
    assert node_pool("slurm", {}) == "default"
    assert node_pool("kubernetes", {"pool": "a100-group"}) == "a100-group"
    assert node_pool("kubernetes", None) == "default"
    assert failure_code_label(None) == "none"
    assert failure_code_label("WorkerLostError") == "WorkerLostError"
    assert failure_code_label("free text a report made up") == "other"
    assert method_label("GET") == "GET"
    assert method_label("BREW") == "other"


def _routes() -> set[str]:
    return {
        s.labels["route"]
        for metric in REQUEST_DURATION.collect()
        for s in metric.samples
        if s.name.endswith("_count")
    }


def test_request_routes_are_templates_and_unknown_paths_one_label(settings: Settings) -> None:
    junk = secrets.token_hex(8)
    app = create_app(settings)
    with TestClient(app, client=("127.0.0.1", 40000)) as c:
        assert c.get(f"/v1/jobs/{junk}").status_code == 401
        assert c.get(f"/no/such/{junk}").status_code == 404
        scraped = c.get("/metrics")
        # An in-process client's address is "testclient": not on the allowed networks.
        refused = TestClient(app).get("/metrics")
    assert scraped.status_code == 200
    routes = _routes()
    assert {"/v1/jobs/{job_id}", "unmatched"} <= routes
    assert not [r for r in routes if junk in r]
    assert junk not in scraped.text
    assert 'route="/v1/jobs/{job_id}",status="401"' in scraped.text
    assert refused.status_code == 403
    assert refused.json()["code"] == "PermissionDeniedError"


def test_events_count_when_their_transaction_commits(sqlite_url: str) -> None:
    db = Database(sqlite_url)
    counted: list[str] = []
    try:
        with db.transaction() as session:
            count_on_commit(session, lambda _s: lambda: counted.append("committed"))
            assert counted == []
        assert counted == ["committed"]
        with pytest.raises(RuntimeError), db.transaction() as session:
            count_on_commit(session, lambda _s: lambda: counted.append("rolled back"))
            raise RuntimeError("the transaction fails")
        with db.transaction() as session:
            pass
        assert counted == ["committed"]
    finally:
        db.dispose()


def test_jobs_are_counted_by_state_and_their_team() -> None:
    from service.services.metrics_collector import _jobs
    from service.states import JobStatus

    family = _jobs(
        [(JobStatus.QUEUED, "vision", 2), (JobStatus.RUNNING, None, 1), (JobStatus.QUEUED, "speech", 1)]
    )
    got = {(s.labels["team"], s.labels["state"]): s.value for s in family.samples}
    assert got[("vision", "queued")] == 2 and got[("vision", "running")] == 0
    assert got[("speech", "queued")] == 1
    assert got[("default", "running")] == 1, "a job older than teams counts under default"
