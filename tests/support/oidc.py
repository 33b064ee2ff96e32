"""A real OpenID provider for the tests: npm's ``oidc-provider`` (a certified OpenID Connect
provider library) run by Node with ``tests/support/oidc_provider.js``, one per test process.

The library is installed by ``.ci/oidc.sh`` into the CI cache (never the repository); its
folder comes from ``TORCHYARD_OIDC_PROVIDER_DIR`` or the cache. Without Node or the library the
tests skip with a message, unless ``TORCHYARD_REQUIRE_OIDC=1`` (CI), where that is a failure.

The test process makes the provider's signing keys (so it can also sign the forged tokens the
API must refuse with the provider's very key) and hands them over in the configuration;
:meth:`OidcServer.configure` replaces clients, accounts or keys while it runs (key rotation,
a user removed from a group).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("oidc_provider.js")
REQUIRE_OIDC = os.environ.get("TORCHYARD_REQUIRE_OIDC") == "1"


def provider_dir() -> Path | None:
    configured = os.environ.get("TORCHYARD_OIDC_PROVIDER_DIR")
    if configured:
        path = Path(configured)
        return path if (path / "node_modules" / "oidc-provider").is_dir() else None
    found = subprocess.run(
        ["bash", str(REPO / ".ci" / "oidc.sh"), "--cached-only"], capture_output=True, text=True, check=False
    )
    if found.returncode != 0:
        return None
    path = Path(found.stdout.strip().splitlines()[-1])
    return path if (path / "node_modules" / "oidc-provider").is_dir() else None


def require_oidc() -> Path:
    def unavailable(message: str) -> None:
        if REQUIRE_OIDC:
            pytest.fail(message + " and TORCHYARD_REQUIRE_OIDC=1")
        pytest.skip(message + "; run .ci/oidc.sh (needs node and npm) to run the OpenID Connect tests")

    if shutil.which("node") is None:
        unavailable("node not found")
    folder = provider_dir()
    if folder is None:
        unavailable("npm's oidc-provider is not installed (.ci/oidc.sh)")
    assert folder is not None
    return folder


def new_key(kid: str) -> RSAKey:
    return RSAKey.generate_key(2048, parameters={"kid": kid, "use": "sig", "alg": "RS256"}, private=True)


class OidcServer:
    """The provider on a loopback port of its own."""

    def __init__(self, modules: Path, folder: Path, port: int) -> None:
        self.modules = modules
        self.folder = folder
        self.port = port
        self.issuer = f"http://127.0.0.1:{port}"
        self.resource = "urn:torchyard-test:api"
        self.keys = [new_key("key-1")]
        self.config: dict[str, Any] = {
            "issuer": self.issuer,
            "resource": self.resource,
            "clients": [],
            "accounts": {},
            "jwks": self._jwks(),
        }
        self.process: subprocess.Popen[str] | None = None
        self.log_path = folder / "oidc-provider.log"

    def _jwks(self) -> dict[str, Any]:
        return {"keys": [key.as_dict(private=True) for key in self.keys]}

    def start(self) -> OidcServer:
        path = self.folder / "oidc-config.json"
        path.write_text(json.dumps(self.config))
        log = self.log_path.open("w")
        self.process = subprocess.Popen(
            ["node", str(SCRIPT), str(self.modules), str(self.port), str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the OpenID provider stopped:\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.issuer + "/.well-known/openid-configuration", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the OpenID provider did not start:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def configure(self, **changes: Any) -> None:
        """Replace parts of the configuration (clients, accounts); the provider is rebuilt."""
        self.config.update(changes)
        response = httpx.post(self.issuer + "/__test/config", json=changes, timeout=10)
        assert response.status_code == 204, response.text

    def add_clients(self, *clients: dict[str, Any]) -> None:
        ids = {c["client_id"] for c in clients}
        kept = [c for c in self.config["clients"] if c["client_id"] not in ids]
        self.configure(clients=[*kept, *clients])

    def set_account(self, sub: str, **account: Any) -> None:
        self.configure(accounts={**self.config["accounts"], sub: account})

    def rotate_keys(self, kid: str) -> RSAKey:
        """A new signing key first (the provider signs with it from now on), the old kept."""
        key = new_key(kid)
        self.keys = [key, *self.keys]
        self.configure(jwks=self._jwks())
        return key

    def sign(self, claims: dict[str, Any], key: RSAKey | None = None) -> str:
        """A JWT signed with ``key`` (default: the provider's current key), as the provider would."""
        key = key or self.keys[0]
        header = {"alg": "RS256", "kid": key.kid, "typ": "at+jwt"}
        return jwt.encode(header, claims, KeySet([key]))

    def access_claims(self, sub: str, **overrides: Any) -> dict[str, Any]:
        now = int(time.time())
        account = self.config["accounts"].get(sub, {})
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": sub,
            "aud": self.resource,
            "iat": now,
            "exp": now + 600,
            "scope": "api",
            "client_id": "torchyard-cli",
            "email": account.get("email"),
            "groups": account.get("groups", []),
        }
        claims.update(overrides)
        return claims
