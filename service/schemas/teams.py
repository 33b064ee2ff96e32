"""Users, teams and the queue (docs/teams.md): requests and answers."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel


class QuotaBody(StrictModel):
    pool: str = Field(default="default", min_length=1, max_length=100)
    nominal: int = Field(
        ge=0, le=10_000_000, description="Units (GPUs, or CPU slots) the team owns in the pool."
    )
    borrowing_limit: int | None = Field(
        default=None, ge=0, le=10_000_000, description="How many more it may borrow (null: no limit)."
    )
    lending_limit: int | None = Field(
        default=None,
        ge=0,
        le=10_000_000,
        description="How many of its idle units others may borrow (null: all).",
    )


class TeamCreate(StrictModel):
    name: str = Field(min_length=1, max_length=100)
    quotas: list[QuotaBody] = Field(default_factory=list, max_length=100)
    weight: float = Field(default=1.0, gt=0, le=1000, strict=False)
    preempt_within: bool = Field(
        default=False, description="A higher-priority job of the team may preempt a lower-priority one of it."
    )
    slurm_account: str | None = Field(default=None, min_length=1, max_length=100)
    kueue_queue: str | None = Field(default=None, min_length=1, max_length=100)


class TeamUpdate(StrictModel):
    quotas: list[QuotaBody] | None = Field(default=None, max_length=100)
    weight: float | None = Field(default=None, gt=0, le=1000, strict=False)
    preempt_within: bool | None = None
    slurm_account: str | None = Field(default=None, max_length=100)
    kueue_queue: str | None = Field(default=None, max_length=100)


class PoolUsage(BaseModel):
    pool: str
    used: int
    nominal: int
    borrowing_limit: int | None
    lending_limit: int | None
    borrowed: int
    lent: int


class TeamPublic(BaseModel):
    name: str
    weight: float
    preempt_within: bool
    slurm_account: str | None
    kueue_queue: str | None
    quotas: list[QuotaBody]
    usage: list[PoolUsage]
    members: list[str]
    created_at: datetime


class TeamList(BaseModel):
    items: list[TeamPublic]


class UserCreate(StrictModel):
    name: str = Field(min_length=1, max_length=100)
    teams: list[str] = Field(default_factory=list, max_length=100, description="The first is the default.")
    admin: bool = False


class UserUpdate(StrictModel):
    teams: list[str] | None = Field(default=None, max_length=100)
    admin: bool | None = None
    disabled: bool | None = Field(default=None, description="A disabled user's tokens stop working at once.")


class UserPublic(BaseModel):
    name: str
    admin: bool
    teams: list[str]
    disabled: bool
    created_at: datetime


class UserList(BaseModel):
    items: list[UserPublic]


class QueuedPublic(BaseModel):
    position: int = Field(description="1: the next job admitted, in the order of the next pass.")
    id: str
    name: str
    team: str | None
    priority: int
    units: int
    usage: PoolUsage | None = Field(description="The team's use of its quota in the pool now.")
    reason: str | None = Field(description="Why it waits, as the last scheduling pass found.")
    created_at: datetime


class QueueList(BaseModel):
    items: list[QueuedPublic]


class UsagePoint(BaseModel):
    at: datetime = Field(description="The minute of the sample.")
    used: int
    nominal: int
    borrowed: int
    lent: int


class TeamUsageSeries(BaseModel):
    team: str
    pool: str
    items: list[UsagePoint] = Field(description="One a minute, oldest first (kept for 7 days).")
