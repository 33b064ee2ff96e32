"""Teams' use of their quotas over time (docs/teams.md): a sample per team and pool each
minute, written by the upkeep of whichever API replica comes first, kept for a week; the
teams page charts it (``GET /v1/teams/{name}/usage``).

A sample is what ``GET /v1/teams/{name}`` shows at that moment: units held, the team's
nominal quota, what it borrows past it and what of its idle nominal others borrow.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.engine import Database
from service.db.models import TeamUsage
from service.db.types import utcnow
from service.services.fair_share import load_ledger
from service.services.teams import DEFAULT_POOL, pool_usage

# How long samples are kept.
RETENTION = timedelta(days=7)
# A replica skips the minute when another wrote a sample this recently.
_FRESH = timedelta(seconds=50)


def _minute(when: datetime) -> datetime:
    return when.replace(second=0, microsecond=0)


def sample(db: Database, now: datetime | None = None) -> int:
    """Write this minute's sample of every team in every pool it has a quota or units in,
    and drop the samples older than a week. Returns the rows written: 0 when a sample is
    less than 50 s old, or another replica wrote this minute's first."""
    now = now or utcnow()
    try:
        with db.transaction() as session:
            newest = session.scalar(select(func.max(TeamUsage.at)))
            if newest is not None and now - newest < _FRESH:
                return 0
            # The ledger's capacity and unit word play no part in the usage numbers.
            ledger = load_ledger(session, {}, "units")
            at = _minute(now)
            written = 0
            for team_id, book in ledger.teams.items():
                if not team_id:  # jobs older than teams, in no team
                    continue
                for pool in sorted(set(book.quotas) | set(book.used) | {DEFAULT_POOL}):
                    use = pool_usage(ledger.teams, team_id, pool)
                    session.add(
                        TeamUsage(
                            team_id=team_id,
                            pool=pool,
                            at=at,
                            used=use["used"],
                            nominal=use["nominal"],
                            borrowed=use["borrowed"],
                            lent=use["lent"],
                        )
                    )
                    written += 1
            session.execute(delete(TeamUsage).where(TeamUsage.at < now - RETENTION))
    except IntegrityError:
        # Another replica wrote this minute's sample between our look and our write.
        return 0
    return written


def points(session: Session, team_id: str, pool: str, since: datetime) -> list[TeamUsage]:
    """A team's samples in ``pool`` from ``since`` on, oldest first."""
    return list(
        session.scalars(
            select(TeamUsage)
            .where(TeamUsage.team_id == team_id, TeamUsage.pool == pool, TeamUsage.at >= since)
            .order_by(TeamUsage.at)
        )
    )
