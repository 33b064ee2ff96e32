"""``torchyard webhooks add|list|rm|deliveries`` in this process (``torchyard.cli.main``)
against a live service: the secret printed once, never listed; a 422 and a 404 as one-line
errors. The deliveries themselves: tests/service/test_webhooks.py."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import LiveServer
from tests.support.factories import auth, create_token
from torchyard.cli import main


def _run(capsys: pytest.CaptureFixture[str], options: list[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*argv, *options])
    out, err = capsys.readouterr()
    return code, out, err


def test_webhooks_add_list_deliveries_rm(live_server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
        user = create_token(admin, "user", "eve")
    options = ["--url", live_server.url, "--token", user]
    url = "https://hooks.example.com/torchyard"

    code, out, err = _run(
        capsys, options, "webhooks", "add", url, "--event", "job.failed", "--event", "sweep.ended"
    )
    assert code == 0, err
    hook_id = out.strip()
    secret = err.split("shown this once; keep it where the receiver can read it): ")[1].strip()
    assert len(secret) >= 43

    code, out, err = _run(capsys, options, "webhooks", "list")
    assert code == 0, err
    assert hook_id in out and url in out and "job.failed, sweep.ended" in out and secret not in out
    code, out, _ = _run(capsys, options, "webhooks", "list", "--json")
    assert [h["id"] for h in json.loads(out)] == [hook_id] and secret not in out

    code, out, err = _run(capsys, options, "webhooks", "deliveries", hook_id, "--json")
    assert code == 0, err
    assert json.loads(out) == {"items": [], "next_cursor": None}

    code, _, err = _run(
        capsys, options, "webhooks", "add", "ftp://hooks.example.com/", "--event", "job.failed"
    )
    assert code == 1 and "error: ValidationError:" in err and "http://" in err, err
    with pytest.raises(SystemExit):
        _run(capsys, options, "webhooks", "add", url, "--event", "job.done")
    assert "invalid choice: 'job.done'" in capsys.readouterr().err

    code, out, err = _run(capsys, options, "webhooks", "rm", hook_id)
    assert code == 0 and f"deleted webhook {hook_id}" in out, err
    code, _, err = _run(capsys, options, "webhooks", "rm", hook_id)
    assert code == 1 and "error: NotFoundError:" in err, err
    code, out, _ = _run(capsys, options, "webhooks", "list", "--json")
    assert json.loads(out) == []
