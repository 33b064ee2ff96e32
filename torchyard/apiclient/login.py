"""``torchyard login``: the OAuth 2.0 device authorization grant (RFC 8628) with the API's
OpenID provider (docs/oidc.md), and the credentials it keeps.

The API says which provider and client to use (``GET /auth/oidc/config``), so only the API's
URL is needed. The user opens the printed URL anywhere (another machine: it works over SSH)
and enters the code; the CLI polls the token endpoint. The access and refresh tokens are kept
in ``$XDG_CONFIG_HOME/torchyard/credentials.json`` (mode 0600), one entry per API URL; an
access token about to expire is renewed with the refresh token before a command uses it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from torchyard.contract.errors import AuthenticationError, RequestValidationError

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
# An access token with less than this left is renewed before use.
RENEW_MARGIN_S = 60
TIMEOUT_S = 30.0


def credentials_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "torchyard" / "credentials.json"


def _read_all() -> dict[str, Any]:
    try:
        data = json.loads(credentials_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_all(data: dict[str, Any]) -> None:
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(data, indent=2).encode())
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def stored(url: str) -> dict[str, Any] | None:
    entry = _read_all().get(url)
    return entry if isinstance(entry, dict) else None


def _store(url: str, entry: dict[str, Any] | None) -> None:
    data = _read_all()
    if entry is None:
        data.pop(url, None)
    else:
        data[url] = entry
    _write_all(data)


def _entry(
    config: dict[str, Any], tokens: dict[str, Any], previous_refresh: str | None = None
) -> dict[str, Any]:
    expires_in = tokens.get("expires_in")
    return {
        "access_token": tokens["access_token"],
        "refresh_token": tokens.get("refresh_token") or previous_refresh,
        "expires_at": time.time() + float(expires_in) if isinstance(expires_in, int | float) else None,
        "token_endpoint": config["token_endpoint"],
        "client_id": config["client_id"],
        "audience": config.get("audience"),
    }


def provider_config(http: httpx.Client, url: str) -> dict[str, Any]:
    """The API's sign-in configuration; :class:`RequestValidationError` when it has none."""
    response = http.get(url + "/auth/oidc/config")
    if response.status_code == 404:
        raise RequestValidationError("this API does not offer `torchyard login` (it predates OpenID Connect)")
    response.raise_for_status()
    config: dict[str, Any] = response.json()
    if not config.get("enabled"):
        raise RequestValidationError(
            "this API has no OpenID provider set up (TORCHYARD_OIDC_ISSUER): use an API token (--token)"
        )
    if not config.get("device_authorization_endpoint"):
        raise RequestValidationError("the API's OpenID provider offers no device authorization grant")
    return config


def device_login(
    url: str,
    *,
    say: Callable[[str], None] = print,
    http: httpx.Client | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Sign in by the device grant and store the credentials for ``url``; returns them."""
    own = http is None
    http = http or httpx.Client(timeout=TIMEOUT_S)
    try:
        config = provider_config(http, url)
        ask = {"client_id": config["client_id"], "scope": config.get("scopes") or "openid offline_access"}
        if config.get("audience"):
            ask["resource"] = config["audience"]
        started = http.post(config["device_authorization_endpoint"], data=ask)
        if started.status_code != 200:
            raise AuthenticationError(f"the OpenID provider refused the sign-in: {started.text[:300]}")
        device = started.json()
        link = device.get("verification_uri_complete") or device["verification_uri"]
        say(f"To sign in, open {link}")
        say(
            f"and enter the code {device['user_code']} (it expires in {int(device.get('expires_in', 600))} s)."
        )
        interval = float(device.get("interval") or 5)
        deadline = time.monotonic() + float(device.get("expires_in") or 600)
        poll = {
            "grant_type": DEVICE_GRANT,
            "device_code": device["device_code"],
            "client_id": config["client_id"],
        }
        if config.get("audience"):
            poll["resource"] = config["audience"]
        while time.monotonic() < deadline:
            sleep(interval)
            answer = http.post(config["token_endpoint"], data=poll)
            body = (
                answer.json() if answer.headers.get("content-type", "").startswith("application/json") else {}
            )
            if answer.status_code == 200:
                entry = _entry(config, body)
                _store(url, entry)
                return entry
            error = body.get("error")
            if error == "authorization_pending":
                continue
            if error == "slow_down":
                interval += 5
                continue
            raise AuthenticationError(f"the sign-in did not complete: {error or answer.status_code}")
        raise AuthenticationError(
            "the sign-in code expired before it was entered: run `torchyard login` again"
        )
    finally:
        if own:
            http.close()


def logout(url: str) -> bool:
    """Forget the credentials of ``url``; whether there were any."""
    if stored(url) is None:
        return False
    _store(url, None)
    return True


def access_token(url: str) -> str | None:
    """The stored access token of ``url``, renewed with the refresh token when it expires
    soon; None when there is no login (or its renewal was refused: the login is forgotten)."""
    entry = stored(url)
    if entry is None or not entry.get("access_token"):
        return None
    expires_at = entry.get("expires_at")
    if expires_at is None or float(expires_at) - RENEW_MARGIN_S > time.time():
        return str(entry["access_token"])
    refresh = entry.get("refresh_token")
    if not refresh:
        return str(entry["access_token"])
    form = {"grant_type": "refresh_token", "refresh_token": refresh, "client_id": entry["client_id"]}
    if entry.get("audience"):
        form["resource"] = entry["audience"]
    try:
        answer = httpx.post(entry["token_endpoint"], data=form, timeout=TIMEOUT_S)
    except httpx.HTTPError:
        return str(entry["access_token"])  # the provider is unreachable: the API will say
    if answer.status_code != 200:
        _store(url, None)
        return None
    renewed = _entry(
        {
            "token_endpoint": entry["token_endpoint"],
            "client_id": entry["client_id"],
            "audience": entry.get("audience"),
        },
        answer.json(),
        previous_refresh=refresh,
    )
    _store(url, renewed)
    return str(renewed["access_token"])
