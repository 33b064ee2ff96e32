"""Users, teams and the queue (docs/teams.md): teams with their quotas and use of them (now
and over time), users and their teams (admins), and the waiting jobs in the order of the
next scheduling pass."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from torchyard.apiclient.models import ApiModel
from torchyard.apiclient.transport import Transport, segment


class Quota(ApiModel):
    pool: str = "default"
    nominal: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None


class PoolUsage(ApiModel):
    pool: str
    used: int
    nominal: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None
    borrowed: int = 0
    lent: int = 0


class Team(ApiModel):
    name: str
    weight: float = 1.0
    preempt_within: bool = False
    slurm_account: str | None = None
    kueue_queue: str | None = None
    quotas: list[Quota] = []
    usage: list[PoolUsage] = []
    members: list[str] = []
    created_at: datetime | None = None


class UsagePoint(ApiModel):
    at: datetime
    used: int
    nominal: int
    borrowed: int
    lent: int


class TeamUsage(ApiModel):
    team: str
    pool: str
    items: list[UsagePoint]


class User(ApiModel):
    name: str
    admin: bool = False
    teams: list[str] = []
    disabled: bool = False
    created_at: datetime | None = None


class Queued(ApiModel):
    position: int
    id: str
    name: str
    team: str | None = None
    priority: int = 0
    units: int
    usage: PoolUsage | None = None
    reason: str | None = None
    created_at: datetime | None = None


def _quotas(quotas: Sequence[Quota | dict[str, Any]]) -> list[dict[str, Any]]:
    return [q.model_dump(exclude_none=True) if isinstance(q, Quota) else dict(q) for q in quotas]


class TeamCalls:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def list_teams(self) -> list[Team]:
        """The teams with their quotas and usage (admins: all; others: their own)."""
        data = self._transport.json("GET", "/v1/teams")
        return [Team.model_validate(item) for item in data["items"]]

    def get_team(self, name: str) -> Team:
        return Team.model_validate(self._transport.json("GET", f"/v1/teams/{segment(name)}"))

    def create_team(self, name: str, quotas: Sequence[Quota | dict[str, Any]] = (), **options: Any) -> Team:
        """Create a team (admins); ``options``: weight, preempt_within, slurm_account, kueue_queue."""
        body = {"name": name, "quotas": _quotas(quotas), **options}
        return Team.model_validate(self._transport.json("POST", "/v1/teams", json=body))

    def update_team(
        self, name: str, quotas: Sequence[Quota | dict[str, Any]] | None = None, **options: Any
    ) -> Team:
        """Change a team (admins): ``quotas`` replace its quotas whole; ``options`` as for
        :meth:`create_team` (an empty slurm_account or kueue_queue clears it)."""
        body = dict(options)
        if quotas is not None:
            body["quotas"] = _quotas(quotas)
        return Team.model_validate(self._transport.json("PATCH", f"/v1/teams/{segment(name)}", json=body))

    def team_usage(self, name: str, *, since: datetime | None = None, pool: str = "default") -> TeamUsage:
        """The team's use of its quota in ``pool``, a sample a minute (default: the last day)."""
        params: dict[str, Any] = {"pool": pool}
        if since is not None:
            params["since"] = since.isoformat()
        data = self._transport.json("GET", f"/v1/teams/{segment(name)}/usage", params=params)
        return TeamUsage.model_validate(data)

    def list_users(self) -> list[User]:
        data = self._transport.json("GET", "/v1/users")
        return [User.model_validate(item) for item in data["items"]]

    def create_user(self, name: str, teams: Sequence[str] = (), *, admin: bool = False) -> User:
        """Create a user (admins) in ``teams`` (the first is their default; none: ``default``)."""
        body = {"name": name, "teams": list(teams), "admin": admin}
        return User.model_validate(self._transport.json("POST", "/v1/users", json=body))

    def update_user(
        self,
        name: str,
        *,
        teams: Sequence[str] | None = None,
        admin: bool | None = None,
        disabled: bool | None = None,
    ) -> User:
        """Change a user's teams, admin flag, or disable them (their tokens stop working)."""
        body: dict[str, Any] = {}
        if teams is not None:
            body["teams"] = list(teams)
        if admin is not None:
            body["admin"] = admin
        if disabled is not None:
            body["disabled"] = disabled
        return User.model_validate(self._transport.json("PATCH", f"/v1/users/{segment(name)}", json=body))

    def queue(self) -> list[Queued]:
        """The waiting jobs you may see, in the order of the next scheduling pass."""
        data = self._transport.json("GET", "/v1/queue")
        return [Queued.model_validate(item) for item in data["items"]]
