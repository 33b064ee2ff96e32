"""Sign-in with an OpenID provider (docs/oidc.md), against a real one: npm's oidc-provider
(tests/support/oidc.py), one per test process, and a live API in front of a real Chromium.

The web UI signs in through the provider's login form (authorization code + PKCE) and lands
signed in with an HttpOnly cookie; a session past its lifetime is renewed by the refresh token
and ends when the provider refuses it; the callback refuses a tampered state, a missing,
expired or altered sign-in cookie, the provider's error and a replayed code with a 4xx and no
session; ``torchyard login`` (a process of its own) signs in by the device grant, the test
entering the printed code as the user would, and later commands use it; the provider's access tokens are taken as bearer tokens
while expired, tampered, wrong-audience and wrong-issuer ones are refused; keys the provider
rotates in are picked up; a user removed from a group loses that team at their next request;
a disabled user's session and open stream stop.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit

import httpx
import pytest
from sqlalchemy import func, select, update

from service.config import Settings
from service.db.engine import Database
from service.db.models import WebSession
from service.db.types import utcnow
from service.services.oidc import session_hash
from service.services.webhooks import fernet
from tests.conftest import LiveServer, free_port
from tests.support.factories import auth
from tests.support.oidc import OidcServer, new_key, require_oidc
from tests.support.ui_browser import chromium_fixture, open_ui_fixture  # noqa: F401

WEB_CLIENT = "torchyard-web"
WEB_SECRET = "web-secret-for-tests-only"
CLI_CLIENT = "torchyard-cli"


@pytest.fixture(scope="session")
def oidc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcServer]:
    """The provider, once per test process."""
    modules = require_oidc()
    server = OidcServer(modules, tmp_path_factory.mktemp("oidc"), free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(
    oidc_server: OidcServer, tmp_path_factory: pytest.TempPathFactory, sqlite_template: Path
) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("oidc-api")
    database = folder / "torchyard.db"
    shutil.copyfile(sqlite_template, database)
    port = free_port()
    public = f"http://127.0.0.1:{port}"
    oidc_server.add_clients(
        {
            "client_id": WEB_CLIENT,
            "client_secret": WEB_SECRET,
            "redirect_uris": [public + "/auth/oidc/callback"],
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "client_secret_basic",
        },
        {
            "client_id": CLI_CLIENT,
            "grant_types": ["urn:ietf:params:oauth:grant-type:device_code", "refresh_token"],
            "response_types": [],
            "redirect_uris": [],
            "token_endpoint_auth_method": "none",
            "application_type": "native",
        },
        {
            "client_id": "other-service",
            "client_secret": "other-secret-for-tests",
            "grant_types": ["client_credentials"],
            "response_types": [],
            "redirect_uris": [],
        },
    )
    oidc_server.configure(
        accounts={
            "alice": {"email": "alice@example.org", "name": "alice", "groups": ["vision", "staff"]},
            "bob": {"email": "bob@example.org", "name": "bob", "groups": ["vision", "nlp"]},
            "carol": {"email": "carol@example.org", "name": "carol", "groups": ["torchyard-admins"]},
            "dave": {"email": "dave@example.org", "name": "dave", "groups": ["nlp"]},
        }
    )
    settings = Settings(
        data_dir=folder / "data",
        database_url=f"sqlite:///{database}",
        public_url=public,
        oidc_issuer=oidc_server.issuer,
        oidc_client_id=WEB_CLIENT,
        oidc_client_secret=WEB_SECRET,
        oidc_cli_client_id=CLI_CLIENT,
        oidc_audience=oidc_server.resource,
        oidc_admin_group="torchyard-admins",
    )
    server = LiveServer(settings, port=port).start()
    admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=30)
    for team in ("vision", "nlp"):
        assert admin.post("/v1/teams", json={"name": team, "quotas": []}).status_code == 201
    admin.close()
    yield server
    server.stop()


@pytest.fixture
def admin(api: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=30) as client:
        yield client


def _provider_login(page: Any, login: str) -> None:
    """Fill the provider's own login form as the user would."""
    page.wait_for_selector("input[name=login]")
    page.fill("input[name=login]", login)
    page.fill("input[name=password]", "any password")
    page.click("button[type=submit]")


def _web_sign_in(open_ui: Any, api: LiveServer, login: str) -> Any:
    ui = open_ui(api.url)
    ui.page.goto("/")
    ui.page.click("#oidc-signin")
    _provider_login(ui.page, login)
    ui.page.wait_for_url(api.url + "/**")
    ui.page.wait_for_selector("#whoami")
    return ui


def _session_cookie(ui: Any) -> dict[str, Any]:
    cookies = [c for c in ui.context.cookies() if c["name"] == "torchyard_session"]
    assert len(cookies) == 1, cookies
    return dict(cookies[0])


def test_the_web_ui_signs_in_through_the_providers_login_form(api: LiveServer, open_ui: Any) -> None:
    config = httpx.get(api.url + "/auth/oidc/config").json()
    assert config["enabled"] is True and config["client_id"] == CLI_CLIENT
    ui = _web_sign_in(open_ui, api, "alice")
    cookie = _session_cookie(ui)
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Lax" and cookie["secure"] is False
    assert ui.page.evaluate("document.cookie") == ""
    who = ui.context.request.get(api.url + "/v1/whoami").json()
    assert who["user"] == "alice" and who["email"] == "alice@example.org"
    assert who["teams"] == ["vision"] and who["role"] == "user"
    ui.page.wait_for_function("document.querySelector('#whoami').textContent.includes('alice@example.org')")
    # Sign-out revokes the server-side session: the cookie's value is refused from then on.
    value = cookie["value"]
    assert httpx.post(api.url + "/auth/logout", cookies={"torchyard_session": value}).status_code == 204
    refused = httpx.get(api.url + "/v1/whoami", cookies={"torchyard_session": value})
    assert refused.status_code == 401, refused.text


def test_the_admin_group_makes_an_admin_and_sign_ins_are_audited(
    api: LiveServer, open_ui: Any, admin: httpx.Client
) -> None:
    ui = _web_sign_in(open_ui, api, "carol")
    who = ui.context.request.get(api.url + "/v1/whoami").json()
    assert who["role"] == "admin" and who["user"] == "carol"
    assert ui.context.request.get(api.url + "/v1/users").status == 200
    events = admin.get("/v1/audit", params={"action": "auth.oidc.sign_in"}).json()["items"]
    carol = [e for e in events if e["actor"]["name"] == "carol@example.org"]
    assert carol and carol[0]["via"] == "oidc" and carol[0]["outcome"] == 200


def _cli_env(api: LiveServer, config_home: Path) -> dict[str, str]:
    """The environment of a CLI subprocess: the API's URL, no token, its own config folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_URL=api.url, XDG_CONFIG_HOME=str(config_home))
    return env


def _run_cli(env: dict[str, str], workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchyard.cli", *args],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _cli_login(api: LiveServer, open_ui: Any, login: str, env: dict[str, str], workdir: Path) -> str:
    """``torchyard login`` as a process of its own; the test reads the URL and code it prints
    and enters them in the provider's device page, as the user would in a browser on any
    machine. Returns what the command printed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "torchyard.cli", "login"],
        env=env,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert process.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 20
        while len(lines) < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert len(lines) >= 2, (lines, process.poll())
        url = re.search(r"open (\S+)", lines[0])
        code = re.search(r"code (\S+) ", lines[1])
        assert url and code, lines
        ui = open_ui(api.url)
        ui.page.goto(url.group(1))
        typed = ui.page.locator("input[name=user_code]:not([type=hidden])")
        if typed.count():
            typed.fill(code.group(1))
            ui.page.click("button[type=submit]")
        for _ in range(6):
            ui.page.wait_for_load_state()
            if process.poll() is not None or "sign-in success" in ui.page.content().lower():
                break
            if ui.page.locator("input[name=login]").count():
                _provider_login(ui.page, login)
            else:
                ui.page.locator("button[type=submit]").first.click()
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=5)
    stderr = process.stderr.read() if process.stderr else ""
    assert process.returncode == 0, (process.returncode, lines, stderr)
    return "".join(lines)


def test_cli_login_by_the_device_grant_then_commands_use_the_access_token(
    api: LiveServer, open_ui: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchyard.apiclient import login as cli_login

    config_home, workdir = tmp_path / "config", tmp_path / "work"
    workdir.mkdir()
    env = _cli_env(api, config_home)
    printed = _cli_login(api, open_ui, "bob", env, workdir)
    path = config_home / "torchyard" / "credentials.json"
    assert f"Signed in to {api.url}" in printed and str(path) in printed
    assert path.stat().st_mode & 0o777 == 0o600
    entry = json.loads(path.read_text())[api.url]
    assert entry["access_token"] and entry["refresh_token"]
    who = httpx.get(api.url + "/v1/whoami", headers=auth(entry["access_token"])).json()
    assert who["user"] == "bob" and who["teams"] == ["vision", "nlp"]
    # Another command, no token given: the stored access token is the one it uses.
    jobs = _run_cli(env, workdir, "--json", "jobs")
    assert jobs.returncode == 0, (jobs.stdout, jobs.stderr)
    # An expired access token is renewed with the refresh token before a command uses it.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    data = json.loads(path.read_text())
    data[api.url]["expires_at"] = time.time() - 1
    path.write_text(json.dumps(data))
    renewed = cli_login.access_token(api.url)
    assert renewed and renewed != entry["access_token"]
    assert httpx.get(api.url + "/v1/whoami", headers=auth(renewed)).status_code == 200
    assert path.stat().st_mode & 0o777 == 0o600
    # `torchyard logout` forgets them.
    logout = _run_cli(env, workdir, "logout")
    assert logout.returncode == 0 and f"Signed out of {api.url}" in logout.stdout, (
        logout.stdout,
        logout.stderr,
    )
    assert api.url not in json.loads(path.read_text())


def test_bad_provider_tokens_are_refused(api: LiveServer, oidc_server: OidcServer) -> None:
    good = oidc_server.sign(oidc_server.access_claims("dave"))
    assert httpx.get(api.url + "/v1/whoami", headers=auth(good)).status_code == 200
    now = int(time.time())
    expired = oidc_server.sign(oidc_server.access_claims("dave", iat=now - 7200, exp=now - 3600))
    wrong_audience = oidc_server.sign(oidc_server.access_claims("dave", aud="urn:torchyard-test:other"))
    wrong_issuer = oidc_server.sign(oidc_server.access_claims("dave", iss="http://127.0.0.1:1"))
    header, payload, signature = good.split(".")
    tampered = ".".join([header, payload[:-2] + ("AA" if payload[-2:] != "AA" else "BB"), signature])
    stranger = oidc_server.sign(oidc_server.access_claims("dave"), key=new_key("not-the-providers"))
    not_yet = oidc_server.sign(oidc_server.access_claims("dave", nbf=now + 3600))
    for name, token in [
        ("expired", expired),
        ("wrong audience", wrong_audience),
        ("wrong issuer", wrong_issuer),
        ("tampered", tampered),
        ("unknown key", stranger),
        ("not valid yet", not_yet),
    ]:
        answer = httpx.get(api.url + "/v1/whoami", headers=auth(token))
        assert answer.status_code == 401, (name, answer.text)
    # A real token of the provider for another resource (client credentials) is refused too.
    issued = httpx.post(
        oidc_server.issuer + "/token",
        data={"grant_type": "client_credentials", "resource": "urn:torchyard-test:other", "scope": "api"},
        auth=("other-service", "other-secret-for-tests"),
    )
    assert issued.status_code == 200, issued.text
    other = httpx.get(api.url + "/v1/whoami", headers=auth(issued.json()["access_token"]))
    assert other.status_code == 401, other.text


def test_keys_the_provider_rotates_in_are_picked_up(api: LiveServer, oidc_server: OidcServer) -> None:
    before = oidc_server.sign(oidc_server.access_claims("dave"))
    assert httpx.get(api.url + "/v1/whoami", headers=auth(before)).status_code == 200
    time.sleep(2.1)  # past the refetch interval of the earlier tests' unknown key
    key = oidc_server.rotate_keys(f"key-{time.monotonic_ns()}")
    published = httpx.get(oidc_server.issuer + "/jwks").json()["keys"]
    assert published[0]["kid"] == key.kid
    after = oidc_server.sign(oidc_server.access_claims("dave"), key=key)
    assert httpx.get(api.url + "/v1/whoami", headers=auth(after)).status_code == 200
    assert httpx.get(api.url + "/v1/whoami", headers=auth(before)).status_code == 200


def test_a_user_removed_from_a_group_loses_the_team_at_the_next_request(
    api: LiveServer, oidc_server: OidcServer
) -> None:
    oidc_server.set_account("erin", email="erin@example.org", name="erin", groups=["vision", "nlp"])
    token = oidc_server.sign(oidc_server.access_claims("erin"))
    assert httpx.get(api.url + "/v1/whoami", headers=auth(token)).json()["teams"] == ["vision", "nlp"]
    oidc_server.set_account("erin", email="erin@example.org", name="erin", groups=["vision", "unknown-group"])
    token = oidc_server.sign(oidc_server.access_claims("erin"))
    assert httpx.get(api.url + "/v1/whoami", headers=auth(token)).json()["teams"] == ["vision"]


def test_a_disabled_users_session_and_open_stream_stop(
    api: LiveServer, open_ui: Any, admin: httpx.Client
) -> None:
    ui = _web_sign_in(open_ui, api, "dave")
    cookies = {"torchyard_session": _session_cookie(ui)["value"]}
    assert httpx.get(api.url + "/v1/whoami", cookies=cookies).status_code == 200
    ended = threading.Event()
    opened = threading.Event()

    def follow() -> None:
        with httpx.stream("GET", api.url + "/v1/jobs/events", cookies=cookies, timeout=60) as response:
            assert response.status_code == 200
            opened.set()
            for _ in response.iter_bytes():
                pass
        ended.set()

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    assert opened.wait(10)
    assert admin.patch("/v1/users/dave", json={"disabled": True}).status_code == 200
    assert ended.wait(10), "the open stream of a disabled user did not end"
    assert httpx.get(api.url + "/v1/whoami", cookies=cookies).status_code == 401


# --- web sessions renewed by the refresh token --------------------------------------------------


@pytest.fixture(scope="module")
def database(api: LiveServer) -> Iterator[Database]:
    """The API's own database, for what a test must read or move back in it (a session's expiry)."""
    db = Database(api.settings.database_url)
    yield db
    db.dispose()


def _session_row(database: Database, value: str) -> WebSession:
    with database.session() as session:
        row = session.scalars(select(WebSession).where(WebSession.id_hash == session_hash(value))).one()
        session.expunge(row)
        return row


def _expire_session(database: Database, value: str) -> None:
    """Move the session's expiry into the past, as if its lifetime had run out."""
    with database.session() as session:
        session.execute(
            update(WebSession)
            .where(WebSession.id_hash == session_hash(value))
            .values(expires_at=utcnow() - timedelta(minutes=1))
        )
        session.commit()


def test_an_expired_session_is_renewed_by_the_refresh_token_until_the_provider_refuses(
    api: LiveServer, open_ui: Any, oidc_server: OidcServer, database: Database
) -> None:
    oidc_server.set_account("frank", email="frank@example.org", name="frank", groups=["vision"])
    ui = _web_sign_in(open_ui, api, "frank")
    cookies = {"torchyard_session": _session_cookie(ui)["value"]}
    value = cookies["torchyard_session"]
    assert httpx.get(api.url + "/v1/whoami", cookies=cookies).json()["teams"] == ["vision"]
    first = _session_row(database, value)
    assert first.refresh_token and first.expires_at > utcnow() + timedelta(minutes=50)

    # Past its lifetime: the next request renews it at the provider (a refresh grant), and the
    # groups of the fresh access token apply: the provider moved frank to nlp meanwhile.
    oidc_server.set_account("frank", email="frank@example.org", name="frank", groups=["nlp"])
    _expire_session(database, value)
    renewed = httpx.get(api.url + "/v1/whoami", cookies=cookies)
    assert renewed.status_code == 200, renewed.text
    assert renewed.json()["user"] == "frank" and renewed.json()["teams"] == ["nlp"]
    row = _session_row(database, value)
    assert row.revoked_at is None and row.expires_at > utcnow() + timedelta(minutes=50)
    # The browser's cookie keeps working: the web UI's own requests go on.
    assert ui.context.request.get(api.url + "/v1/whoami").status == 200

    # frank leaves: the provider no longer knows the account and refuses the refresh grant;
    # the session ends and stays ended (a sign-in is needed).
    oidc_server.configure(accounts={k: v for k, v in oidc_server.config["accounts"].items() if k != "frank"})
    _expire_session(database, value)
    refused = httpx.get(api.url + "/v1/whoami", cookies=cookies)
    assert refused.status_code == 401, refused.text
    assert "refused" in refused.json()["message"]
    assert _session_row(database, value).revoked_at is not None
    assert httpx.get(api.url + "/v1/whoami", cookies=cookies).status_code == 401


# --- the callback's refusals ----------------------------------------------------------------------

LOGIN_COOKIE = "torchyard_oidc_login"


def _authorization(api: LiveServer, login: str) -> tuple[str, str]:
    """A web sign-in driven over plain HTTP up to the provider's redirect back: the browser's
    login cookie (set by ``GET /auth/oidc/login``) and the callback URL with the code."""
    with httpx.Client(timeout=30) as browser:
        started = browser.get(api.url + "/auth/oidc/login")
        assert started.status_code == 303, started.text
        sealed = started.cookies[LOGIN_COOKIE]
        url = started.headers["location"]
        for _ in range(10):
            if url.startswith(api.url + "/auth/oidc/callback?"):
                return sealed, url
            answer = browser.get(url)
            if answer.status_code == 200:  # the provider's login form, filled as the user would
                form = re.search(r'<form[^>]*action="([^"]+)"', answer.text)
                assert form and 'name="login"' in answer.text, answer.text[:1000]
                answer = browser.post(
                    urljoin(url, form.group(1)),
                    data={"prompt": "login", "login": login, "password": "any password"},
                )
            assert answer.status_code in (302, 303), answer.text[:1000]
            url = urljoin(url, answer.headers["location"])
    raise AssertionError(f"the provider never sent the browser back: {url}")


def _with_state(url: str, state: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    return parts._replace(query=urlencode({**query, "state": state})).geturl()


def _sessions(database: Database) -> int:
    with database.session() as session:
        return int(session.scalar(select(func.count()).select_from(WebSession)) or 0)


def test_the_callback_refuses_what_is_not_its_sign_in_with_a_4xx_and_no_session(
    api: LiveServer, oidc_server: OidcServer, database: Database
) -> None:
    oidc_server.set_account("grace", email="grace@example.org", name="grace", groups=["vision"])
    callback = api.url + "/auth/oidc/callback"
    before = _sessions(database)
    sealed, url = _authorization(api, "grace")
    kept = fernet(api.settings).decrypt(sealed.encode())
    too_old = fernet(api.settings).encrypt_at_time(kept, int(time.time()) - 11 * 60).decode()
    altered = sealed[:-4] + ("AAAA" if sealed[-4:] != "AAAA" else "BBBB")
    refusals: list[tuple[str, httpx.Response, int, str]] = [
        (
            "the provider's error",
            httpx.get(callback, params={"error": "access_denied", "error_description": "the user declined"}),
            401,
            "access_denied",
        ),
        ("no login cookie", httpx.get(url), 422, "no sign-in in progress"),
        (
            "a tampered state",
            httpx.get(_with_state(url, "x" * 43), cookies={LOGIN_COOKIE: sealed}),
            422,
            "state",
        ),
        ("no state", httpx.get(_with_state(url, ""), cookies={LOGIN_COOKIE: sealed}), 422, "state"),
        ("an expired login cookie", httpx.get(url, cookies={LOGIN_COOKIE: too_old}), 422, "expired"),
        ("an altered login cookie", httpx.get(url, cookies={LOGIN_COOKIE: altered}), 422, "altered"),
    ]
    for name, answer, status, says in refusals:
        assert answer.status_code == status, (name, answer.status_code, answer.text)
        assert says in answer.json()["message"], (name, answer.text)
        assert "torchyard_session" not in answer.cookies, name
    assert _sessions(database) == before
    # The same code with the right state and cookie signs grace in: none of the above used it up.
    signed_in = httpx.get(url, cookies={LOGIN_COOKIE: sealed})
    assert signed_in.status_code == 303, signed_in.text
    assert httpx.get(api.url + "/v1/whoami", cookies=signed_in.cookies).json()["user"] == "grace"
    assert _sessions(database) == before + 1
    # The code replayed (the login cookie still at hand): the provider refuses it, no second session.
    replayed = httpx.get(url, cookies={LOGIN_COOKIE: sealed})
    assert replayed.status_code == 401, replayed.text
    assert "refused" in replayed.json()["message"] and "torchyard_session" not in replayed.cookies
    assert _sessions(database) == before + 1
