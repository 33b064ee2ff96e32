"""``torchyard audit`` and ``torchyard audit export`` in this process (``torchyard.cli.main``)
against a live service: the newest events as a table and as JSON, filtered, the export as
JSON lines, and a user's 403 as a one-line error. The trail itself: tests/service/test_audit.py."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import LiveServer
from tests.support.factories import auth, create_token
from torchyard.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_audit_list_and_export_through_the_cli(
    live_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = ["--url", live_server.url, "--token", live_server.admin_token]
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as http:
        user = create_token(http, "user", "alice")
        assert http.post("/v1/teams", json={"name": "vision"}).status_code == 201
        assert http.patch("/v1/teams/vision", json={"weight": 3}).status_code == 200
        assert http.patch("/v1/teams/nope", json={"weight": 3}).status_code == 404

    code, out, _ = _run(capsys, "audit", "--action", "team.", *admin)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["AT", "ACTOR", "VIA", "FROM", "ACTION", "TARGET", "STATUS"]
    assert [line.split()[-3:] for line in lines[1:]] == [
        ["team.update", "team:nope", "404"],
        ["team.update", "team:vision", "200"],
        ["team.create", "team:vision", "201"],
    ]
    assert all(" admin " in line and " token " in line for line in lines[1:])

    code, out, _ = _run(capsys, "audit", "--target", "team:vision", "--limit", "1", "--json", *admin)
    assert code == 0
    events = json.loads(out)
    assert [(e["action"], e["details"]) for e in events] == [("team.update", {"weight": 3})]

    code, out, _ = _run(capsys, "audit", "export", "--since", "1h", *admin)
    assert code == 0
    exported = [json.loads(line) for line in out.splitlines()]
    assert [e["action"] for e in exported] == ["token.create", "team.create", "team.update", "team.update"]
    assert user not in out

    code, _, err = _run(capsys, "audit", "--url", live_server.url, "--token", user)
    assert code != 0
    assert err == "error: PermissionDeniedError: this route needs an admin token\n"
