"""Sign-in with the organisation's OpenID provider (docs/oidc.md).

The protocol is Authlib's: the authorization request with PKCE, state and nonce, the code
exchange and the refresh (:class:`authlib.integrations.requests_client.OAuth2Session`), and
the tokens' signatures and claims (``joserfc``, Authlib's JOSE library: iss, aud, exp, nbf,
nonce). Nothing here checks a signature or a claim by hand.

The provider's discovery document is read once (``<issuer>/.well-known/openid-configuration``),
its keys (JWKS) are cached; a token signed with a key id not among them makes one refetch,
so keys the provider rotated in are picked up, while a stream of forged key ids costs at most
one fetch per :data:`JWKS_REFETCH_INTERVAL_S`.

A user of the provider is found by issuer and subject. Their teams are the teams named by the
groups claim (groups naming no team are ignored) and they are an admin when the admin group is
among them; both are brought up to date at every sign-in and every request made with a
provider's token. They act through a token row of their own that is never handed out (so
what they make is owned as everything else is, docs/teams.md).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
from authlib.integrations.requests_client import OAuth2Session
from joserfc import jwt
from joserfc.errors import InvalidKeyIdError, JoseError
from joserfc.jwk import KeySet
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Team, TeamMember, Token, User
from service.db.types import utcnow
from service.services.tokens import DEFAULT_TEAM, Principal, default_team, hash_token
from service.states import Role
from torchyard.contract.errors import AuthenticationError, ServiceUnavailableError

log = logging.getLogger(__name__)

CALLBACK_PATH = "/auth/oidc/callback"
# A token whose key id is unknown refetches the provider's keys at most this often.
JWKS_REFETCH_INTERVAL_S = 2.0
# The discovery document is read again after this long (a provider may add endpoints).
METADATA_TTL_S = 3600.0
HTTP_TIMEOUT_S = 10.0
# Signature algorithms taken (asymmetric only: a provider's HMAC would need the client secret).
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
LEEWAY_S = 30
SIGN_IN_TOKEN_NAME = "sign-in"


@dataclass(frozen=True)
class Identity:
    """Who the provider says a token is for."""

    issuer: str
    subject: str
    email: str | None
    name: str | None
    # None when the token has no groups claim: then the user's teams and admin flag are left
    # as they are (a provider may put the groups in its ID tokens only).
    groups: tuple[str, ...] | None


class OidcProvider:
    """The configured provider: its metadata, keys, and the token checks (thread-safe)."""

    def __init__(self, settings: Settings, *, session: requests.Session | None = None) -> None:
        assert settings.oidc_issuer and settings.oidc_client_id and settings.public_url
        self.issuer = settings.oidc_issuer
        self.client_id = settings.oidc_client_id
        self.client_secret = (
            settings.oidc_client_secret.get_secret_value()
            if settings.oidc_client_secret is not None
            else None
        )
        self.cli_client_id = settings.oidc_cli_client_id or settings.oidc_client_id
        self.audience = settings.oidc_audience or settings.public_url
        self.redirect_uri = settings.public_url + CALLBACK_PATH
        self.groups_claim = settings.oidc_groups_claim
        self.admin_group = settings.oidc_admin_group
        self.scopes = settings.oidc_scopes
        self._http = session or requests.Session()
        self._lock = threading.Lock()
        self._metadata: dict[str, Any] | None = None
        self._metadata_at = 0.0
        self._keys: KeySet | None = None
        self._keys_at = 0.0

    # --- the provider's documents ---------------------------------------------------------

    def _get_json(self, url: str) -> dict[str, Any]:
        try:
            response = self._http.get(url, timeout=HTTP_TIMEOUT_S)
            response.raise_for_status()
            body = response.json()
        except (requests.RequestException, ValueError) as exc:
            raise ServiceUnavailableError(f"the OpenID provider could not be reached: {exc}") from exc
        if not isinstance(body, dict):
            raise ServiceUnavailableError(f"the OpenID provider answered {url} with no JSON object")
        return body

    def metadata(self) -> dict[str, Any]:
        """The discovery document (cached for :data:`METADATA_TTL_S`)."""
        with self._lock:
            if self._metadata is not None and time.monotonic() - self._metadata_at < METADATA_TTL_S:
                return self._metadata
        body = self._get_json(self.issuer.rstrip("/") + "/.well-known/openid-configuration")
        if body.get("issuer") != self.issuer:
            raise ServiceUnavailableError(
                f"the OpenID provider's discovery document names issuer {body.get('issuer')!r}, "
                f"not TORCHYARD_OIDC_ISSUER {self.issuer!r}"
            )
        with self._lock:
            self._metadata, self._metadata_at = body, time.monotonic()
        return body

    def endpoint(self, name: str) -> str:
        url = self.metadata().get(name)
        if not isinstance(url, str) or not url:
            raise ServiceUnavailableError(f"the OpenID provider has no {name}")
        return url

    def _key_set(self, *, refetch: bool) -> KeySet | None:
        """The provider's keys: cached; ``refetch`` reads them again unless that was just done."""
        with self._lock:
            keys, fetched_at = self._keys, self._keys_at
        if keys is not None and not refetch:
            return keys
        if keys is not None and time.monotonic() - fetched_at < JWKS_REFETCH_INTERVAL_S:
            return None  # just fetched: the unknown key is not the provider's
        body = self._get_json(self.endpoint("jwks_uri"))
        try:
            fresh = KeySet.import_key_set(body)  # type: ignore[arg-type]
        except (JoseError, ValueError, TypeError) as exc:
            raise ServiceUnavailableError(f"the OpenID provider's keys could not be read: {exc}") from exc
        with self._lock:
            self._keys, self._keys_at = fresh, time.monotonic()
        return fresh

    # --- tokens ---------------------------------------------------------------------------

    def _decode(self, token: str, claims: dict[str, Any]) -> dict[str, Any]:
        """The verified claims of ``token``: signed by one of the provider's keys, with the
        registered claims of ``claims`` (and exp, nbf, iat) checked."""
        keys = self._key_set(refetch=False)
        decoded = None
        for attempt in range(2):
            if keys is None:
                break
            try:
                decoded = jwt.decode(token, keys, algorithms=ALGORITHMS)
                break
            except InvalidKeyIdError:
                if attempt == 0:
                    keys = self._key_set(refetch=True)
                    continue
                keys = None
            except (JoseError, ValueError, TypeError) as exc:
                raise AuthenticationError(f"invalid token: {_why(exc)}") from exc
        if decoded is None:
            raise AuthenticationError("invalid token: signed by a key the OpenID provider does not publish")
        registry = jwt.JWTClaimsRegistry(
            leeway=LEEWAY_S, exp={"essential": True}, sub={"essential": True}, **claims
        )
        try:
            registry.validate(decoded.claims)
        except JoseError as exc:
            raise AuthenticationError(f"invalid token: {_why(exc)}") from exc
        return dict(decoded.claims)

    def access_token_claims(self, token: str) -> dict[str, Any]:
        """The claims of a provider's access token (a JWT, RFC 9068) issued for this API."""
        return self._decode(
            token,
            {
                "iss": {"essential": True, "value": self.issuer},
                "aud": {"essential": True, "value": self.audience},
            },
        )

    def id_token_claims(self, token: str, nonce: str) -> dict[str, Any]:
        """The claims of an ID token issued to the web client for the sign-in of ``nonce``."""
        claims = self._decode(
            token,
            {
                "iss": {"essential": True, "value": self.issuer},
                "aud": {"essential": True, "value": self.client_id},
                "nonce": {"essential": True, "value": nonce},
            },
        )
        audiences = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        if len(audiences) > 1 and claims.get("azp") != self.client_id:
            raise AuthenticationError("invalid token: the ID token was issued to another client (azp)")
        return claims

    def identity(self, claims: dict[str, Any]) -> Identity:
        groups = claims.get(self.groups_claim)
        if isinstance(groups, str):
            groups = [groups]
        email = claims.get("email")
        name = claims.get("preferred_username") or claims.get("name")
        return Identity(
            issuer=str(claims["iss"]),
            subject=str(claims["sub"]),
            email=email if isinstance(email, str) else None,
            name=name if isinstance(name, str) else None,
            groups=tuple(g for g in groups if isinstance(g, str)) if isinstance(groups, list) else None,
        )

    # --- the web client -------------------------------------------------------------------

    def _client(self, **kwargs: Any) -> OAuth2Session:
        client = OAuth2Session(
            client_id=self.client_id,
            client_secret=self.client_secret,
            token_endpoint_auth_method="client_secret_basic" if self.client_secret else "none",
            scope=self.scopes,
            redirect_uri=self.redirect_uri,
            code_challenge_method="S256",
            **kwargs,
        )
        return client

    def authorization_url(self, state: str, nonce: str, code_verifier: str) -> str:
        """Where to send the browser: the authorization request, with PKCE (S256)."""
        url, _ = self._client().create_authorization_url(
            self.endpoint("authorization_endpoint"),
            state=state,
            nonce=nonce,
            code_verifier=code_verifier,
            resource=self.audience,
        )
        return str(url)

    def exchange(self, code: str, code_verifier: str) -> dict[str, Any]:
        """The tokens for an authorization code (ID, access and maybe refresh token)."""
        try:
            token = self._client().fetch_token(
                self.endpoint("token_endpoint"),
                grant_type="authorization_code",
                code=code,
                code_verifier=code_verifier,
                resource=self.audience,
                timeout=HTTP_TIMEOUT_S,
            )
        except requests.RequestException as exc:
            raise ServiceUnavailableError(f"the OpenID provider could not be reached: {exc}") from exc
        except Exception as exc:  # Authlib's OAuthError and its kin: the provider said no
            raise AuthenticationError(f"the OpenID provider refused the sign-in: {exc}") from exc
        return dict(token)

    def refresh(self, refresh_token: str) -> dict[str, Any]:
        """New tokens for a refresh token; :class:`AuthenticationError` if the provider refuses.

        No scope is asked (RFC 6749 §6: the scope granted at sign-in): a provider may have
        granted less than the sign-in asked (``offline_access`` is often dropped from it) and
        refuses a refresh that asks for more. The resource is asked again (RFC 8707), so the
        access token is one for this API."""
        try:
            token = self._client().refresh_token(
                self.endpoint("token_endpoint"),
                refresh_token=refresh_token,
                scope=None,
                resource=self.audience,
                timeout=HTTP_TIMEOUT_S,
            )
        except requests.RequestException as exc:
            raise ServiceUnavailableError(f"the OpenID provider could not be reached: {exc}") from exc
        except Exception as exc:
            raise AuthenticationError(f"the OpenID provider refused the refresh: {exc}") from exc
        return dict(token)

    def public_config(self) -> dict[str, Any]:
        """What a client needs to sign in (``GET /auth/oidc/config``)."""
        metadata = self.metadata()
        return {
            "enabled": True,
            "issuer": self.issuer,
            "provider": _provider_name(self.issuer),
            "client_id": self.cli_client_id,
            "audience": self.audience,
            "scopes": self.scopes,
            "device_authorization_endpoint": metadata.get("device_authorization_endpoint"),
            "token_endpoint": metadata.get("token_endpoint"),
        }


def _why(exc: Exception) -> str:
    if isinstance(exc, JoseError):
        return exc.description or exc.error
    return str(exc) or type(exc).__name__


def _provider_name(issuer: str) -> str:
    return urlsplit(issuer).hostname or issuer


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and not token.startswith("ty")


def new_secret() -> str:
    return secrets.token_urlsafe(32)


# --- users and teams -----------------------------------------------------------------------------

_NAME_CHARS = re.compile(r"[^A-Za-z0-9._@-]+")


def _user_name(session: Session, identity: Identity) -> str:
    base = identity.name or (identity.email.split("@")[0] if identity.email else None) or identity.subject
    base = _NAME_CHARS.sub("-", base).strip("-")[:150] or "user"
    taken = set(session.scalars(select(User.name).where(User.name.like(f"{base}%"))))
    candidate, n = base, 1
    while candidate in taken:
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def _wanted_teams(session: Session, groups: Sequence[str]) -> list[Team]:
    """The teams the groups name, in the groups' order; ``default`` when none does."""
    if groups:
        found = {t.name: t for t in session.scalars(select(Team).where(Team.name.in_(list(groups))))}
        teams = [found[g] for g in dict.fromkeys(groups) if g in found]
        if teams:
            return teams
    return [default_team(session)] if DEFAULT_TEAM not in groups else []


def sync_user(session: Session, provider: OidcProvider, identity: Identity) -> User:
    """The user of ``identity`` (made at first sign-in), with its admin flag, teams and token
    brought up to date; writes only what changed. The caller commits. A disabled user is
    refused with :class:`AuthenticationError`."""
    user = session.scalars(
        select(User).where(User.oidc_issuer == identity.issuer, User.oidc_subject == identity.subject)
    ).first()
    if user is None:
        user = User(
            name=_user_name(session, identity),
            admin=False,
            oidc_issuer=identity.issuer,
            oidc_subject=identity.subject,
            email=identity.email,
            created_at=utcnow(),
        )
        session.add(user)
        session.flush()
    if user.disabled_at is not None:
        raise AuthenticationError("this user is disabled")
    if identity.email and user.email != identity.email:
        user.email = identity.email
    if identity.groups is not None:
        _sync_groups(session, provider, user, identity.groups)
    _sync_token(session, user)
    return user


def _sync_groups(session: Session, provider: OidcProvider, user: User, groups: Sequence[str]) -> None:
    if provider.admin_group is not None:
        admin = provider.admin_group in groups
        if user.admin != admin:
            user.admin = admin
    teams = _wanted_teams(session, groups)
    held = list(
        session.scalars(
            select(TeamMember.team_id).where(TeamMember.user_id == user.id).order_by(TeamMember.position)
        )
    )
    if held != [t.id for t in teams]:
        for member in session.scalars(select(TeamMember).where(TeamMember.user_id == user.id)):
            session.delete(member)
        session.flush()
        for position, team in enumerate(teams):
            session.add(TeamMember(team_id=team.id, user_id=user.id, position=position))


def _sync_token(session: Session, user: User) -> None:
    role = Role.ADMIN if user.admin else Role.USER
    token = session.get(Token, user.sign_in_token_id) if user.sign_in_token_id else None
    if token is None:
        token = Token(
            name=f"{user.name} ({SIGN_IN_TOKEN_NAME})",
            role=role,
            # Never handed out: a hash of a secret nobody keeps.
            token_hash=hash_token(new_secret()),
            user_id=user.id,
        )
        session.add(token)
        session.flush()
        user.sign_in_token_id = token.id
    elif token.revoked_at is not None:
        raise AuthenticationError("this user's sign-in was revoked")
    elif token.role != role:
        token.role = role
    session.flush()


def principal_of(session: Session, user: User, *, session_id: str | None = None) -> Principal:
    """The principal a provider's user acts as (read after :func:`sync_user` or a session)."""
    token = session.get(Token, user.sign_in_token_id) if user.sign_in_token_id else None
    if token is None or token.revoked_at is not None or user.disabled_at is not None:
        raise AuthenticationError("this user's sign-in was revoked")
    teams = session.execute(
        select(Team.id, Team.name)
        .join(TeamMember, TeamMember.team_id == Team.id)
        .where(TeamMember.user_id == user.id)
        .order_by(TeamMember.position, Team.name)
    ).all()
    owner_ids = tuple(session.scalars(select(Token.id).where(Token.user_id == user.id).order_by(Token.id)))
    return Principal(
        id=token.id,
        name=user.name,
        role=Role.ADMIN if user.admin else Role.USER,
        last_used_at=token.last_used_at,
        user_id=user.id,
        owner_ids=owner_ids,
        team_ids=tuple(t.id for t in teams),
        team_names=tuple(t.name for t in teams),
        session_id=session_id,
    )


def authenticate_access_token(session: Session, provider: OidcProvider, token: str) -> Principal:
    """The principal of a provider's access token; the user's teams and admin flag follow the
    token's groups (a write only when they changed). The caller commits."""
    identity = provider.identity(provider.access_token_claims(token))
    user = sync_user(session, provider, identity)
    return principal_of(session, user)


def session_hash(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()
