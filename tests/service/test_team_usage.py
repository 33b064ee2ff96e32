"""Teams' use of their quotas over time (docs/teams.md): the upkeep's sample once a minute
(one per minute even with several replicas), its week of retention, and
``GET /v1/teams/{name}/usage`` (a member sees their team's, not another's)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.config import Settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.db.models import TeamUsage
from service.db.types import utcnow
from service.services import team_usage
from service.services.scheduler import run_pass
from service.services.upkeep import upkeep_pass
from tests.service.test_fair_share import make_team, nodes, team_job
from tests.support.factories import auth
from tests.support.queue_fill import owner_and_dataset


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    upgrade(db_url)
    database = Database(db_url)
    yield database
    database.dispose()


def _samples(db: Database, team_id: str | None = None) -> list[TeamUsage]:
    with db.read_session() as s:
        stmt = select(TeamUsage).order_by(TeamUsage.at)
        if team_id is not None:
            stmt = stmt.where(TeamUsage.team_id == team_id)
        return list(s.scalars(stmt))


@pytest.mark.both_databases
def test_the_upkeep_samples_each_teams_usage_once_a_minute_and_keeps_a_week(
    db: Database, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings: Settings = make_settings(master_port_min=30800, master_port_max=30899)
    owner = owner_and_dataset(db)
    nodes(db, owner, 1, 8)
    vision = make_team(db, "vision", 4, 4)
    speech = make_team(db, "speech", 4)
    team_job(db, owner, vision, 1, 6)
    run_pass(db, settings)  # vision holds 6: its 4, and 2 of speech's idle 4

    monkeypatch.setattr(upkeep_pass, "_last_team_usage", 0.0)
    upkeep_pass.run_upkeep_pass(db, settings, schedule=False)
    (v,) = _samples(db, vision)
    assert (v.pool, v.used, v.nominal, v.borrowed, v.lent) == ("default", 6, 4, 2, 0)
    (s,) = _samples(db, speech)
    assert (s.used, s.nominal, s.borrowed, s.lent) == (0, 4, 0, 2)
    assert v.at.second == 0 and v.at.microsecond == 0  # the minute of the sample

    # The next pass within the minute samples nothing (the upkeep's own clock) ...
    count = len(_samples(db))
    upkeep_pass.run_upkeep_pass(db, settings, schedule=False)
    assert len(_samples(db)) == count
    # ... and neither does another replica's, finding a sample under 50 s old, or one of
    # the same minute (it cannot write the minute twice).
    assert team_usage.sample(db, v.at + timedelta(seconds=40)) == 0
    assert team_usage.sample(db, v.at + timedelta(seconds=55)) == 0
    assert len(_samples(db)) == count
    # The next minute gets its sample; a week later the first ones are gone.
    assert team_usage.sample(db, v.at + timedelta(seconds=61)) == count
    assert len(_samples(db, vision)) == 2
    assert team_usage.sample(db, v.at + timedelta(days=7, seconds=30)) == count
    with db.read_session() as session:
        assert session.scalar(select(func.min(TeamUsage.at))) == v.at + timedelta(minutes=1)


def test_a_teams_usage_route_for_admins_and_members_only(client: TestClient, settings: Settings) -> None:
    r = client.post("/v1/teams", json={"name": "vision", "quotas": [{"nominal": 4, "borrowing_limit": 2}]})
    assert r.status_code == 201, r.text
    assert client.post("/v1/teams", json={"name": "speech", "quotas": [{"nominal": 4}]}).status_code == 201
    assert client.post("/v1/users", json={"name": "ana", "teams": ["speech"]}).status_code == 201
    r = client.post("/v1/tokens", json={"name": "ana-laptop", "role": "user", "user": "ana"})
    assert r.status_code == 201, r.text
    ana = auth(r.json()["token"])

    db = Database(settings.sqlalchemy_url)
    try:
        # A sample in a minute to come: none the server's own upkeep took can be as new.
        at = utcnow() + timedelta(minutes=2)
        assert team_usage.sample(db, at) >= 2
    finally:
        db.dispose()

    r = client.get("/v1/teams/speech/usage")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["team"] == "speech" and body["pool"] == "default"
    last = body["items"][-1]
    assert {k: last[k] for k in ("used", "nominal", "borrowed", "lent")} == {
        "used": 0,
        "nominal": 4,
        "borrowed": 0,
        "lent": 0,
    }
    assert last["at"].startswith(at.replace(second=0, microsecond=0).strftime("%Y-%m-%dT%H:%M:00"))
    assert client.get("/v1/teams/speech/usage", headers=ana).json()["items"][-1] == last

    # since: later than every sample gives none; without a zone, a 422 that says so.
    later = (at + timedelta(minutes=5)).isoformat()
    assert client.get("/v1/teams/speech/usage", params={"since": later}).json()["items"] == []
    r = client.get("/v1/teams/speech/usage", params={"since": "2026-01-02T03:04:05"})
    assert r.status_code == 422 and "time zone" in r.json()["message"]
    assert client.get("/v1/teams/speech/usage", params={"pool": "tpu"}).json()["items"] == []

    # Another team's usage is no business of a member: 404, as for a team that does not exist.
    r = client.get("/v1/teams/vision/usage", headers=ana)
    assert r.status_code == 404 and "team 'vision' not found" in r.json()["message"]
    assert client.get("/v1/teams/nobody/usage").status_code == 404
