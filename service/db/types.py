"""Column types and values every table uses: UTC datetimes, enums stored as their strings,
ids and the current time."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar

from sqlalchemy import BigInteger, DateTime, Integer, String
from sqlalchemy.types import TypeDecorator

# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
SeqInt = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both databases (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


E = TypeVar("E", bound=StrEnum)


class EnumAsString(TypeDecorator[E]):
    """A ``StrEnum`` stored as its value in a VARCHAR column, read back as the enum member.

    The database keeps plain strings (the check constraints list the values), so typing a
    column with it changes no schema. A member compares equal to its string, so filters may
    name either; a string that names no member is written as it is, for the column's check
    constraint to refuse.
    """

    impl = String
    cache_ok = True

    def __init__(self, enum_class: type[E], length: int = 16) -> None:
        super().__init__(length)
        self.enum_class = enum_class

    def process_bind_param(self, value: E | str | None, dialect: Any) -> str | None:
        return None if value is None else str(value)

    def process_result_value(self, value: str | None, dialect: Any) -> E | None:
        return None if value is None else self.enum_class(value)
