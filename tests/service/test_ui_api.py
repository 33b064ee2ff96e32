"""What the web UI relies on, over HTTP on SQLite and PostgreSQL: its page and assets,
the response headers, the sign-in cookie and its CSRF rule, the owner check behind the
cookie, chart series reduced on the server, and the jobs list's event stream."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.routes.ui import STATIC_DIR
from service.api.security import CSRF_HEADER, SESSION_COOKIE
from service.config import Settings
from service.services.metric_series import Answer, AnswerCache, Series
from tests.conftest import LiveServer
from tests.support import REPO_ROOT
from tests.support.attempt_history import FIRST, SECOND, restarted_job
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id
from tests.support.report_helpers import point, post_report, start_running_job


def _submit(client: Any, settings: Settings, token: str, name: str = "job") -> str:
    """A queued job of ``token``'s user (on a node registered for it, which never heartbeats)."""
    register_node(client, create_token(client, "worker"), f"node-{name}", units=1)
    uid = token_id(client, token)
    train, val = insert_dataset(settings, uid), insert_dataset(settings, uid)
    r = client.post(
        "/v1/jobs", json=job_spec(train, val, name=name, resources={"node_count": 1}), headers=auth(token)
    )
    assert r.status_code == 201, r.text
    job_id: str = r.json()["id"]
    return job_id


def test_every_answer_carries_the_security_headers(client: TestClient) -> None:
    for path in ("/", "/ui/app.js", "/ui/style.css", "/v1/whoami", "/healthz", "/v1/nope", "/docs"):
        r = client.get(path)
        assert r.status_code < 500, path
        assert r.headers["x-content-type-options"] == "nosniff", path
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"], path
        assert r.headers["x-frame-options"] == "DENY", path
    page = client.get("/")
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "default-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp
    # The docs pages allow no inline script either (Swagger UI starts from a script file).
    for docs in ("/docs", "/redoc"):
        docs_csp = client.get(docs).headers["content-security-policy"]
        assert "script-src 'self';" in docs_csp and "frame-ancestors 'none'" in docs_csp
        assert "unsafe-eval" not in docs_csp and "script-src 'self' 'unsafe-inline'" not in docs_csp


def test_the_ui_is_served_from_the_package_with_nothing_remote_or_inline() -> None:
    files = sorted(p for p in STATIC_DIR.iterdir() if p.is_file())
    assert {"index.html", "app.js", "chart.js", "style.css"} <= {p.name for p in files}
    index = (STATIC_DIR / "index.html").read_text()
    assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", index) == []  # no inline script
    assert not re.search(r"\son[a-z]+=", index)  # no inline event handlers
    for path in files:
        text = path.read_text()
        remote = [u for u in re.findall(r"https?://[^\s\"')]+", text) if u != "http://www.w3.org/2000/svg"]
        assert remote == [], (path.name, remote)
        assert ".innerHTML" not in text and "eval(" not in text, path.name


def test_every_asset_is_served_and_a_folder_is_not_listed(client: TestClient) -> None:
    for path in sorted(p for p in STATIC_DIR.rglob("*") if p.is_file()):
        name = path.relative_to(STATIC_DIR).as_posix()
        r = client.get(f"/ui/{name}")
        assert r.status_code == 200, name
        assert r.content == path.read_bytes()
    assert client.get("/ui/").status_code == 404
    assert client.get("/ui/vendor/").status_code == 404
    assert client.get("/ui/../config.py").status_code == 404


def test_the_vendored_chart_library_is_the_recorded_version_license_and_checksum() -> None:
    vendor = STATIC_DIR / "vendor"
    record = json.loads((vendor / "VENDOR.json").read_text())
    assert set(record["sha256"]) == {p.name for p in vendor.iterdir()} - {"VENDOR.json"}
    for name, digest in record["sha256"].items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
    script = (vendor / "uPlot.iife.min.js").read_text()
    assert script.startswith(f"/*! https://github.com/leeoniya/uPlot (v{record['version']}) */")
    assert record["license"] in (vendor / "uPlot.LICENSE").read_text().split("\n", 1)[0]
    # The page loads it as a script file of its own, and docs/ui.md records the same.
    index = (STATIC_DIR / "index.html").read_text()
    assert '<script defer src="/ui/vendor/uPlot.iife.min.js"></script>' in index
    docs = (REPO_ROOT / "docs" / "ui.md").read_text()
    assert f"uPlot {record['version']}" in docs and f"license: {record['license']}" in docs
    for digest in record["sha256"].values():
        assert digest in docs


def test_sign_in_sets_an_httponly_strict_cookie_and_cookie_writes_need_the_csrf_header(
    settings: Settings,
) -> None:
    with TestClient(create_app(settings)) as anon:
        admin_token = settings.admin_token_path.read_text().strip()
        admin = {"Authorization": f"Bearer {admin_token}"}
        r = anon.post("/v1/tokens", json={"name": "ana", "role": "user"}, headers=admin)
        user = r.json()["token"]
        worker = anon.post("/v1/tokens", json={"name": "w", "role": "worker"}, headers=admin).json()["token"]

        assert anon.post("/v1/session", json={"token": "ty_wrong"}).json()["code"] == "AuthenticationError"
        refused = anon.post("/v1/session", json={"token": worker})
        assert refused.status_code == 403 and refused.json()["code"] == "PermissionDeniedError"
        assert anon.post("/v1/session", json={"token": user, "extra": 1}).status_code == 422
        # A form of another site can post text/plain (no preflight), never JSON: refused.
        forged = anon.post(
            "/v1/session", content=json.dumps({"token": user}), headers={"Content-Type": "text/plain"}
        )
        assert forged.status_code == 422 and "set-cookie" not in forged.headers
        assert SESSION_COOKIE not in anon.cookies

        r = anon.post("/v1/session", json={"token": user})
        assert r.status_code == 200 and r.json()["name"] == "ana"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"{SESSION_COOKIE}=")
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
        assert "Secure" not in cookie  # plain HTTP here
        assert r.headers["cache-control"] == "no-store"
        assert user not in json.dumps(r.json())

        assert anon.get("/v1/whoami").json()["name"] == "ana"
        denied = anon.post("/v1/jobs/anything/cancel")
        assert denied.status_code == 403 and CSRF_HEADER in denied.json()["message"]
        assert anon.post("/v1/jobs/anything/cancel", headers={CSRF_HEADER: "1"}).status_code == 404
        # A bearer token needs no CSRF header: it is never sent by a browser on its own.
        assert anon.post("/v1/jobs/anything/cancel", headers=auth(user)).status_code == 404

        out = anon.delete("/v1/session")
        assert out.status_code == 204 and "Max-Age=0" in out.headers["set-cookie"]
        assert anon.get("/v1/whoami").status_code == 401

    with TestClient(create_app(settings), base_url="https://testserver") as secure:
        r = secure.post("/v1/session", json={"token": user})
        assert "Secure" in r.headers["set-cookie"]


def test_the_cookie_session_sees_only_its_own_jobs(client: TestClient, settings: Settings) -> None:
    owner = create_token(client, "user", "olga")
    other = create_token(client, "user", "pete")
    job_id = _submit(client, settings, owner, name="olgas")
    with TestClient(create_app(settings)) as browser:
        assert browser.post("/v1/session", json={"token": other}).status_code == 200
        for path in (
            f"/v1/jobs/{job_id}",
            f"/v1/jobs/{job_id}/metrics/series",
            f"/v1/jobs/{job_id}/logs/streams",
            f"/v1/jobs/{job_id}/events",
        ):
            r = browser.get(path)
            assert r.status_code == 404 and r.json()["code"] == "NotFoundError", path
        assert browser.get("/v1/jobs").json()["items"] == []
        r = browser.post(f"/v1/jobs/{job_id}/cancel", headers={CSRF_HEADER: "1"})
        assert r.status_code == 404
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] != "cancelled"


@pytest.mark.both_databases
def test_metric_series_route_reduces_and_says_where_live_points_continue(
    client: TestClient, settings: Settings
) -> None:
    job = start_running_job(settings, client, per_node=1)
    points = [point("train.loss", 2.0 - i * 0.001, epoch=i // 100, step=i) for i in range(600)]
    points[250]["value"] = 9.0  # a spike
    points[400]["value"] = -1.0  # a dip
    for start in range(0, 600, 200):
        assert post_report(client, job, metrics=points[start : start + 200]).status_code == 200
    assert post_report(client, job, metrics=[point("val.top1", 0.5, epoch=0, step=99)]).status_code == 200
    user = auth(job.user_token)
    page = client.get(f"/v1/jobs/{job.job_id}/metrics/series", params={"points": 100}, headers=user).json()
    loss = page["series"]["train.loss"]
    assert loss["count"] == 600 and 50 <= len(loss["x"]) <= 101
    assert 9.0 in loss["y"] and -1.0 in loss["y"]
    assert abs(loss["x"][loss["y"].index(9.0)] - 250) <= 6  # at its stretch's middle step
    assert loss["x"] == sorted(loss["x"]) and loss["x"][-1] >= 590
    assert min(loss["y"]) == -1.0 and max(loss["y"]) == 9.0
    assert page["series"]["val.top1"] == {"x": [99], "y": [0.5], "count": 1}
    # Under the limit, every point as it was stored.
    whole = client.get(f"/v1/jobs/{job.job_id}/metrics/series", params={"points": 1000}, headers=user).json()
    assert whole["series"]["train.loss"]["y"] == [p["value"] for p in points]
    assert whole["series"]["train.loss"]["x"] == list(range(600))
    newest = client.get(f"/v1/jobs/{job.job_id}/metrics", params={"limit": 10000}, headers=user).json()
    assert page["last_seq"] == newest["next_after"]
    after = client.get(f"/v1/jobs/{job.job_id}/metrics", params={"after": page["last_seq"]}, headers=user)
    assert after.json()["items"] == []
    assert (
        client.get(f"/v1/jobs/{job.job_id}/metrics/series", params={"points": 5}, headers=user).status_code
        == 422
    )


def test_metric_series_answered_again_from_memory_until_a_new_point_arrives(
    client: TestClient, settings: Settings
) -> None:
    job = start_running_job(settings, client, per_node=1)
    points = [point("train.loss", 1.0 + (i % 7) * 0.01, epoch=0, step=i) for i in range(300)]
    assert post_report(client, job, metrics=points).status_code == 200
    user = auth(job.user_token)

    def series() -> dict[str, Any]:
        r = client.get(f"/v1/jobs/{job.job_id}/metrics/series", params={"points": 50}, headers=user)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    first = series()
    assert series() == first  # nothing new: the same answer
    loss = first["series"]["train.loss"]
    assert loss["count"] == 300 and max(loss["y"]) < 2
    # One new point, a spike: the next answer has it, and says where live points go on.
    assert post_report(client, job, metrics=[point("train.loss", 7.5, epoch=0, step=300)]).status_code == 200
    after = series()
    assert after["series"]["train.loss"]["count"] == 301
    assert max(after["series"]["train.loss"]["y"]) == 7.5
    assert after["last_seq"] > first["last_seq"]
    # A new metric shows up too.
    assert post_report(client, job, metrics=[point("val.top1", 0.25, epoch=0, step=300)]).status_code == 200
    assert series()["series"]["val.top1"] == {"x": [300], "y": [0.25], "count": 1}


def test_kept_series_answers_are_bounded_by_their_points_least_recently_used_dropped() -> None:
    def answer(n: int) -> Answer:
        return {"m": Series(x=[float(i) for i in range(n)], y=[0.0] * n, count=n)}, n

    cache = AnswerCache(max_points=100)
    cache.put(("db", "a", 10, 1, 1), answer(40))
    cache.put(("db", "b", 10, 1, 1), answer(40))
    assert cache.get(("db", "a", 10, 1, 1)) is not None  # a is now the most recently used
    cache.put(("db", "c", 10, 1, 1), answer(40))  # 120 points: b goes
    assert cache.get(("db", "b", 10, 1, 1)) is None
    assert cache.get(("db", "a", 10, 1, 1)) == answer(40) and cache.points == 80 and len(cache) == 2
    cache.put(("db", "huge", 10, 1, 1), answer(101))  # larger than the bound: not kept
    assert cache.get(("db", "huge", 10, 1, 1)) is None and cache.points == 80


@pytest.mark.both_databases
def test_metric_series_leaves_out_points_a_later_attempt_redid(
    client: TestClient, settings: Settings
) -> None:
    job = restarted_job(client, settings)
    user = auth(job.user_token)
    page = client.get(f"/v1/jobs/{job.job_id}/metrics/series", headers=user).json()
    # Epochs 6 to 12 of attempt 1 were redone by attempt 2: only attempt 2's points are charted.
    expected = {**{e: v for e, v in FIRST.items() if e < 6}, **SECOND}
    loss = page["series"]["val.loss"]
    assert loss == {"x": [10 * e for e in expected], "y": list(expected.values()), "count": 14}
    # The same points as the default metrics history.
    history = client.get(f"/v1/jobs/{job.job_id}/metrics", headers=user).json()["items"]
    assert [(p["step"], p["value"]) for p in history] == list(zip(loss["x"], loss["y"], strict=True))
    everything = client.get(
        f"/v1/jobs/{job.job_id}/metrics", params={"include_superseded": "true"}, headers=user
    ).json()["items"]
    assert len(everything) == 21
    assert page["last_seq"] == everything[-1]["seq"]
    # Reduced (fewer points asked than stored), the superseded values are still left out.
    small = client.get(f"/v1/jobs/{job.job_id}/metrics/series", params={"points": 10}, headers=user).json()
    reduced = small["series"]["val.loss"]
    assert reduced["count"] == 14 and len(reduced["y"]) < 14
    assert min(reduced["y"]) > 0 and max(reduced["y"]) == SECOND[14]


def test_the_jobs_list_stream_sends_changes_of_ones_own_jobs_only(
    live_server: LiveServer, tmp_path: Path
) -> None:
    settings = live_server.settings
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30) as admin:
        alice = create_token(admin, "user", "alice")
        bob = create_token(admin, "user", "bob")
        alices = _submit(admin, settings, alice, name="alices")
        bobs = _submit(admin, settings, bob, name="bobs")
    events: list[dict[str, Any]] = []
    opened = threading.Event()

    def listen() -> None:
        with (
            httpx.Client(base_url=live_server.url, headers=auth(bob), timeout=30) as c,
            c.stream("GET", "/v1/jobs/events") as r,
        ):
            assert r.headers["content-type"].startswith("text/event-stream")
            kind = None
            for line in r.iter_lines():
                opened.set()
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: ") and kind == "job":
                    events.append(json.loads(line[6:]))
                    if events[-1]["status"] == "cancelled":
                        return

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert opened.wait(20)
    # Alice's change comes first: were it leaked, it would be the first event Bob gets.
    assert httpx.post(f"{live_server.url}/v1/jobs/{alices}/cancel", headers=auth(alice)).status_code == 200
    assert httpx.post(f"{live_server.url}/v1/jobs/{bobs}/cancel", headers=auth(bob)).status_code == 200
    thread.join(30)
    assert not thread.is_alive()
    assert {e["id"] for e in events} == {bobs}
    assert events[-1]["status"] == "cancelled" and events[-1]["name"] == "bobs"
    assert events[-1]["finished_at"] is not None
    # What the list shows of each type: the job's type and best values come along.
    assert events[-1]["type"] == "train" and "best" in events[-1]
