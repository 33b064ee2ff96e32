"""Sign-in with an OpenID provider (docs/oidc.md), against a real one: npm's oidc-provider
(tests/support/oidc.py), one per test process, and a live API in front of a real Chromium.

The web UI signs in through the provider's login form (authorization code + PKCE) and lands
signed in with an HttpOnly cookie; ``torchyard login`` signs in by the device grant, the test
entering the code as the user would; the provider's access tokens are taken as bearer tokens
while expired, tampered, wrong-audience and wrong-issuer ones are refused; keys the provider
rotates in are picked up; a user removed from a group loses that team at their next request;
a disabled user's session and open stream stop.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
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


def _cli_login(api: LiveServer, open_ui: Any, login: str, config_home: Path) -> dict[str, Any]:
    """``torchyard login`` in a thread of its own; the test enters the printed code in the
    provider's device page, as the user would in a browser on any machine."""
    from torchyard.apiclient import login as cli_login

    lines: list[str] = []
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["entry"] = cli_login.device_login(
                api.url, say=lines.append, sleep=lambda s: time.sleep(0.5)
            )
        except Exception as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while len(lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) == 2, (lines, result)
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
        if result or "sign-in success" in ui.page.content().lower():
            break
        if ui.page.locator("input[name=login]").count():
            _provider_login(ui.page, login)
        else:
            ui.page.locator("button[type=submit]").first.click()
    thread.join(timeout=30)
    assert "entry" in result, (result, ui.page.content()[:2000])
    return dict(result["entry"])


@pytest.fixture(scope="module")
def config_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("config-home")


def test_cli_login_by_the_device_grant_then_commands_use_the_access_token(
    api: LiveServer, open_ui: Any, config_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchyard.apiclient import login as cli_login
    from torchyard.client import Client

    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    monkeypatch.delenv("TORCHYARD_TOKEN", raising=False)
    entry = _cli_login(api, open_ui, "bob", config_home)
    path = cli_login.credentials_path()
    assert path.stat().st_mode & 0o777 == 0o600
    assert entry["refresh_token"]
    with Client(api.url) as client:
        assert client.token == entry["access_token"]
    who = httpx.get(api.url + "/v1/whoami", headers=auth(entry["access_token"])).json()
    assert who["user"] == "bob" and who["teams"] == ["vision", "nlp"]
    # An expired access token is renewed with the refresh token before a command uses it.
    data = __import__("json").loads(path.read_text())
    data[api.url]["expires_at"] = time.time() - 1
    path.write_text(__import__("json").dumps(data))
    renewed = cli_login.access_token(api.url)
    assert renewed and renewed != entry["access_token"]
    assert httpx.get(api.url + "/v1/whoami", headers=auth(renewed)).status_code == 200
    assert path.stat().st_mode & 0o777 == 0o600
    assert cli_login.logout(api.url) and cli_login.stored(api.url) is None


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
