"""``torchyard queue``, ``team list|show|create|update``, ``user list|create|update`` and
``token create --user`` in this process (``torchyard.cli.main``) against a live service: a
team borrowing from another, a job waiting at its team's quota, a member's view, and the
API's 4xx as one-line errors. Admission itself: tests/service/test_fair_share.py."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id
from torchyard.apiclient.teams import PoolUsage, Team
from torchyard.cli import main
from torchyard.commands.teams import borrowing_lines, usage_text


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(**fast_leases(lease_s=600))  # the node registered by hand never heartbeats
    return s


def _run(capsys: pytest.CaptureFixture[str], options: list[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*argv, *options])
    out, err = capsys.readouterr()
    return code, out, err


def _wait_queue(admin: httpx.Client, job_id: str) -> dict[str, Any]:
    """The job's entry in the queue once a scheduling pass has given it a reason."""
    deadline = time.monotonic() + 20
    while True:
        entry = next((q for q in admin.get("/v1/queue").json()["items"] if q["id"] == job_id), None)
        if entry and entry["reason"]:
            return entry
        assert time.monotonic() < deadline, f"job {job_id} never waited with a reason: {entry}"
        time.sleep(0.1)


def test_teams_users_tokens_and_the_queue_through_the_cli(
    live_server: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    admin_options = ["--url", live_server.url, "--token", live_server.admin_token]

    code, out, err = _run(
        capsys,
        admin_options,
        "team",
        "create",
        "vision",
        "--quota",
        "default=4,borrow=2",
        "--weight",
        "2",
        "--slurm-account",
        "vis",
    )
    assert code == 0, err
    assert "team vision" in out and "weight:          2" in out and "slurm account:   vis" in out
    code, out, err = _run(
        capsys, admin_options, "team", "create", "speech", "--quota", "default=4,lend=3", "--json"
    )
    assert code == 0, err
    speech = json.loads(out)
    assert speech["quotas"] == [
        {"pool": "default", "nominal": 4, "borrowing_limit": None, "lending_limit": 3}
    ]
    # The API's refusals, one line each; a malformed quota never reaches it.
    code, _, err = _run(capsys, admin_options, "team", "create", "vision")
    assert code == 1 and "error: ConflictError: team 'vision' exists" in err, err
    code, _, err = _run(capsys, admin_options, "team", "create", "Vision!")
    assert code == 1 and "error: ValidationError:" in err and "team name" in err, err
    with pytest.raises(SystemExit):
        _run(capsys, admin_options, "team", "create", "audio", "--quota", "default=4,borrow=x")
    assert "expected POOL=UNITS[,borrow=UNITS][,lend=UNITS]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run(capsys, admin_options, "team", "create", "audio", "--quota", "default=4,steal=2")
    assert "borrow= and lend=" in capsys.readouterr().err

    code, out, err = _run(
        capsys, admin_options, "team", "update", "vision", "--preempt-within", "--slurm-account", "", "--json"
    )
    assert code == 0, err
    vision = json.loads(out)
    assert vision["preempt_within"] is True and vision["slurm_account"] is None and vision["weight"] == 2
    code, _, err = _run(capsys, admin_options, "team", "update", "vision")
    assert code == 1 and "nothing to change" in err
    code, _, err = _run(capsys, admin_options, "team", "update", "nobody", "--weight", "1")
    assert code == 1 and "error: NotFoundError: team 'nobody' not found" in err, err

    # Users, and a token for one through the database (as `token create` always did).
    code, out, err = _run(
        capsys, admin_options, "user", "create", "ana", "--team", "speech", "--team", "vision"
    )
    assert code == 0, err
    assert "ana" in out and "speech, vision" in out
    code, _, err = _run(capsys, admin_options, "user", "create", "bo", "--team", "nope")
    assert code == 1 and "error: ValidationError: no team named 'nope'" in err, err
    code, out, err = _run(capsys, admin_options, "user", "update", "ana", "--admin", "--disable", "--json")
    assert code == 0, err
    assert json.loads(out) | {"created_at": None} == {
        "name": "ana",
        "admin": True,
        "teams": ["speech", "vision"],
        "disabled": True,
        "created_at": None,
    }
    code, out, err = _run(capsys, admin_options, "user", "update", "ana", "--no-admin", "--enable")
    assert code == 0 and "active" in out, err
    code, out, _ = _run(capsys, admin_options, "user", "list")
    ana_row = next(line for line in out.splitlines() if line.startswith("ana "))
    assert "no" in ana_row and "speech, vision" in ana_row and "active" in ana_row

    monkeypatch.setenv("TORCHYARD_DATA_DIR", str(live_server.settings.data_dir))
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", live_server.settings.sqlalchemy_url)
    code, out, err = _run(
        capsys, [], "token", "create", "--role", "user", "--name", "ana-laptop", "--user", "ana"
    )
    assert code == 0, err
    ana_token = out.strip()
    code, _, err = _run(capsys, [], "token", "create", "--role", "user", "--name", "x", "--user", "nobody")
    assert code == 1 and "nobody" in err, err
    ana_options = ["--url", live_server.url, "--token", ana_token]

    # 8 units: a vision job of 6 borrows 2 of speech's idle 4; the next one waits at the quota.
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
        register_node(admin, create_token(admin, "worker"), "cpu-1", units=8)
        owner = token_id(admin, ana_token)
        train = insert_dataset(live_server.settings, owner, name="t")
        val = insert_dataset(live_server.settings, owner, name="v")

        def submit(name: str, procs: int) -> str:
            spec = job_spec(train, val, name=name, team="vision")
            spec["resources"] = {"node_count": 1, "process_count_per_node": procs}
            r = httpx.post(f"{live_server.url}/v1/jobs", json=spec, headers=auth(ana_token))
            assert r.status_code == 201, r.text
            return str(r.json()["id"])

        big = submit("big", 6)
        waiting = submit("waits", 2)
        entry = _wait_queue(admin, waiting)
        assert big not in [q["id"] for q in admin.get("/v1/queue").json()["items"]]

    code, out, err = _run(capsys, ana_options, "queue")
    assert code == 0, err
    header, row = out.splitlines()[:2]
    assert header.split()[:6] == ["POS", "JOB", "NAME", "TEAM", "PRIORITY", "UNITS"]
    assert row.split()[:8] == ["1", waiting, "waits", "vision", "0", "2", "6/4", "(+2)"]
    assert entry["reason"] in row
    code, out, _ = _run(capsys, ana_options, "queue", "--json")
    (item,) = json.loads(out)
    assert item["id"] == waiting and item["usage"]["borrowed"] == 2

    code, out, err = _run(capsys, admin_options, "team", "list")
    assert code == 0, err
    table, borrowing = out.split("\n\n")
    assert borrowing.strip() == "vision borrows 2 from speech"
    lines = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert lines["vision"][1:5] == ["2", "default=4,borrow=2", "6/4", "(+2)"]
    assert lines["speech"][2:5] == ["default=4,lend=3", "0/4", "2"]
    code, out, err = _run(capsys, ana_options, "team", "show", "speech")
    assert code == 0, err
    assert "members:         ana" in out
    quota_row = next(line for line in out.splitlines() if line.startswith("default"))
    assert quota_row.split() == ["default", "4", "none", "3", "0", "0", "2"]

    # A member sees their teams; not another's, nor the users.
    assert client_view(capsys, ana_options) == ["speech", "vision"]
    code, _, err = _run(capsys, admin_options, "user", "update", "ana", "--team", "speech")
    assert code == 0, err
    assert client_view(capsys, ana_options) == ["speech"]
    code, _, err = _run(capsys, ana_options, "team", "show", "vision")
    assert code == 1 and "error: NotFoundError: team 'vision' not found" in err, err
    code, out, _ = _run(capsys, ana_options, "queue", "--json")
    assert [q["id"] for q in json.loads(out)] == [waiting]  # still their own job
    code, _, err = _run(capsys, ana_options, "user", "list")
    assert code == 1 and "error: PermissionDeniedError: this route needs an admin token" in err, err


def client_view(capsys: pytest.CaptureFixture[str], options: list[str]) -> list[str]:
    code, out, err = _run(capsys, options, "team", "list", "--json")
    assert code == 0, err
    return [t["name"] for t in json.loads(out)]


def test_usage_text_and_who_borrows_from_whom() -> None:
    def team(
        name: str, used: int, nominal: int, borrowed: int = 0, lent: int = 0, pool: str = "default"
    ) -> Team:
        use = PoolUsage(pool=pool, used=used, nominal=nominal, borrowed=borrowed, lent=lent)
        return Team(name=name, usage=[use])

    assert usage_text(None) == "-"
    assert usage_text(PoolUsage(pool="default", used=3, nominal=4)) == "3/4"
    assert usage_text(PoolUsage(pool="default", used=6, nominal=4, borrowed=2)) == "6/4 (+2)"
    assert borrowing_lines([team("a", 2, 4)]) == []
    assert borrowing_lines([team("vision", 24, 16, borrowed=8), team("speech", 0, 16, lent=8)]) == [
        "vision borrows 8 from speech"
    ]
    # Two lenders are named with what each lends; units no team owns are named as such.
    assert borrowing_lines(
        [team("vision", 10, 4, borrowed=6), team("speech", 0, 2, lent=2), team("nlp", 1, 4, lent=3)]
    ) == ["vision borrows 6 from speech (2), nlp (3), units no team owns (1)"]
    assert borrowing_lines([team("vision", 3, 0, borrowed=3, pool="a100")]) == [
        "vision borrows 3 in pool a100 from units no team owns"
    ]
