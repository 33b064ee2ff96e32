"""Teams on one cluster (docs/teams.md): quotas, borrowing, fair share and preemption to
reclaim, through real scheduling passes (service/services/scheduler.py) on SQLite and
PostgreSQL, each pass one the test made."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from service.config import Settings
from service.db.engine import Database
from service.db.migrate import upgrade
from service.db.models import Attempt, Job, Placement
from service.db.types import utcnow
from service.services import teams
from service.services.attempt_outcomes import finish_preemption, locked_job
from service.services.fair_share import admission_order
from service.services.scheduler import run_pass
from service.services.teams import QuotaSpec
from service.services.transitions import set_placement_status
from service.states import LIVE_ATTEMPT_STATUSES, JobStatus, PlacementStatus
from tests.service.test_scheduler import add_job, add_node
from tests.support.queue_fill import owner_and_dataset
from tests.support.worker_fixtures import finish_job

pytestmark = pytest.mark.both_databases


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    upgrade(db_url)
    database = Database(db_url)
    yield database
    database.dispose()


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(master_port_min=30700, master_port_max=30799, reclaim_min_run_s=0)
    return s


@pytest.fixture
def owner(db: Database) -> tuple[str, str]:
    return owner_and_dataset(db)


def make_team(db: Database, name: str, nominal: int, borrowing: int | None = None, **options: Any) -> str:
    with db.transaction() as s:
        team = teams.create_team(s, name, [QuotaSpec("default", nominal, borrowing)], **options)
        return team.id


def team_job(db: Database, owner: tuple[str, str], team_id: str, nodes: int, procs: int, **kw: Any) -> str:
    job_id = add_job(db, owner, nodes, procs, **kw)
    with db.transaction() as s:
        s.execute(update(Job).where(Job.id == job_id).values(team_id=team_id))
    return job_id


def status(db: Database, job_id: str) -> str:
    with db.read_session() as s:
        return str(s.get_one(Job, job_id).status)


def reason(db: Database, job_id: str) -> str | None:
    with db.read_session() as s:
        return s.get_one(Job, job_id).wait_reason


def asked_to_stop(db: Database, job_id: str) -> bool:
    with db.read_session() as s:
        return any(
            a.preempt_requested_at is not None
            for a in s.scalars(select(Attempt).where(Attempt.job_id == job_id))
        )


def stop_preempted(db: Database, job_id: str) -> None:
    """The job's agents checkpoint and report ``preempted``: placements done, back to the queue."""
    now = utcnow()
    with db.transaction() as s:
        job = locked_job(s, job_id)
        for attempt in s.scalars(
            select(Attempt).where(Attempt.job_id == job_id, Attempt.status.in_(LIVE_ATTEMPT_STATUSES))
        ):
            for p in s.scalars(select(Placement).where(Placement.attempt_id == attempt.id)):
                if p.status != PlacementStatus.DONE:
                    set_placement_status(p, PlacementStatus.DONE, now)
            finish_preemption(s, job, attempt)


def start_running(db: Database, *job_ids: str) -> None:
    """The jobs' agents claimed their placements and started their ranks."""
    with db.transaction() as s:
        s.execute(
            update(Placement)
            .where(Placement.job_id.in_(job_ids), Placement.status == PlacementStatus.ASSIGNED)
            .values(status=PlacementStatus.RUNNING)
        )


def nodes(db: Database, owner: tuple[str, str], count: int, units: int) -> None:
    for i in range(count):
        add_node(db, owner, f"n{i}", units)


def test_without_quotas_the_queue_is_one_line_as_before(
    db: Database, settings: Settings, owner: tuple[str, str]
) -> None:
    nodes(db, owner, 2, 2)
    with db.transaction() as s:
        teams.create_team(s, "vision", [])  # a team, but no quota anywhere
    first = add_job(db, owner, 1, 2)
    second = add_job(db, owner, 2, 2)
    third = add_job(db, owner, 1, 1)  # would fit, but nothing is placed past the first that waits
    run_pass(db, settings)
    assert status(db, first) == JobStatus.SCHEDULED
    assert status(db, second) == status(db, third) == JobStatus.QUEUED
    assert "first in line" in (reason(db, third) or "")


def test_a_team_borrows_idle_units_up_to_its_limit_and_its_reason_names_the_quota(
    db: Database, settings: Settings, owner: tuple[str, str]
) -> None:
    nodes(db, owner, 4, 2)
    vision = make_team(db, "vision", 4, borrowing=2)
    make_team(db, "speech", 4)
    jobs = [team_job(db, owner, vision, 1, 2) for _ in range(4)]
    run_pass(db, settings)
    # 4 units of its own and 2 borrowed from speech's idle quota; the fourth would borrow 4.
    assert [status(db, j) for j in jobs] == ["scheduled"] * 3 + ["queued"]
    assert (
        reason(db, jobs[3]) == "team vision at its quota: 4 of 4 CPU slots in pool default, borrowing 2 of 2"
    )
    with db.read_session() as s:
        usage = teams.pool_usage(teams_ledger(s).teams, vision, "default")
    assert (usage["used"], usage["borrowed"]) == (6, 2)


def teams_ledger(session: Any) -> Any:
    from service.services.fair_share import load_ledger

    return load_ledger(session, {"default": 8}, "CPU slots")


def test_a_team_within_its_quota_gets_its_lent_units_back_by_preemption_of_whole_gangs(
    db: Database, settings: Settings, owner: tuple[str, str]
) -> None:
    nodes(db, owner, 4, 2)
    vision = make_team(db, "vision", 4)
    speech = make_team(db, "speech", 4)
    own = team_job(db, owner, vision, 2, 2)  # 4 units: vision's own
    borrowed = team_job(db, owner, vision, 2, 2, priority=-5)  # 4 more: borrowed from speech
    run_pass(db, settings)
    assert status(db, own) == status(db, borrowed) == JobStatus.SCHEDULED
    start_running(db, own, borrowed)
    wanted = team_job(db, owner, speech, 1, 2)
    run_pass(db, settings)
    # The borrowed gang (2 nodes) is asked to stop, every node of it; the owned one is not.
    assert asked_to_stop(db, borrowed) and not asked_to_stop(db, own)
    assert status(db, wanted) == JobStatus.QUEUED
    assert "reclaiming 4 CPU slots of team speech's quota" in (reason(db, wanted) or "")
    run_pass(db, settings)  # a second pass preempts nothing more while those units come back
    assert "on their way back" in (reason(db, wanted) or "")
    stop_preempted(db, borrowed)
    with db.read_session() as s:
        attempt = s.scalars(select(Attempt).where(Attempt.job_id == borrowed)).one()
        assert attempt.status == "preempted" and "team speech took back its quota" in (
            attempt.failure_message or ""
        )
        job = s.get_one(Job, borrowed)
        assert job.status == JobStatus.QUEUED and job.restarts == 0
    run_pass(db, settings)
    assert status(db, wanted) == JobStatus.SCHEDULED
    # The preempted job waits: the units it borrowed are speech's, in use now.
    assert status(db, borrowed) == JobStatus.QUEUED


def test_a_job_that_ran_less_than_the_minimum_is_not_preempted(
    db: Database, make_settings: Any, owner: tuple[str, str]
) -> None:
    settings: Settings = make_settings(master_port_min=30700, master_port_max=30799, reclaim_min_run_s=3600)
    nodes(db, owner, 2, 2)
    vision = make_team(db, "vision", 2)
    speech = make_team(db, "speech", 2)
    borrowed = [team_job(db, owner, vision, 1, 2) for _ in range(2)]
    run_pass(db, settings)
    start_running(db, *borrowed)
    wanted = team_job(db, owner, speech, 1, 2)
    run_pass(db, settings)
    assert not any(asked_to_stop(db, j) for j in borrowed)
    assert status(db, wanted) == JobStatus.QUEUED
    # Once it has run long enough, it is.
    with db.transaction() as s:
        s.execute(update(Attempt).values(created_at=utcnow() - timedelta(hours=2)))
    run_pass(db, settings)
    assert sum(asked_to_stop(db, j) for j in borrowed) == 1


def test_teams_take_turns_by_fair_share_and_a_quota_change_counts_at_the_next_pass(
    db: Database, settings: Settings, owner: tuple[str, str]
) -> None:
    nodes(db, owner, 4, 1)
    vision = make_team(db, "vision", 2, borrowing=0)
    speech = make_team(db, "speech", 2, borrowing=0)
    flood = [team_job(db, owner, vision, 1, 1) for _ in range(6)]
    late = [team_job(db, owner, speech, 1, 1) for _ in range(2)]
    with db.read_session() as s:
        _, order = admission_order(s, {"default": 4}, "CPU slots")
    # Interleaved: each team in turn while they are at the same share.
    assert [p.job.id for p in order][:4] == [flood[0], late[0], flood[1], late[1]]
    run_pass(db, settings)
    assert sum(status(db, j) == "scheduled" for j in flood) == 2
    assert all(status(db, j) == "scheduled" for j in late)
    with db.transaction() as s:
        teams.set_quotas(s, teams.find_team(s, "vision"), [QuotaSpec("default", 2, None)])
    for j in late:
        finish_job(db, j)
    run_pass(db, settings)
    assert sum(status(db, j) == "scheduled" for j in flood) == 4


def test_a_flood_of_one_team_does_not_hide_the_others_jobs(
    db: Database, settings: Settings, owner: tuple[str, str]
) -> None:
    nodes(db, owner, 4, 1)
    vision = make_team(db, "vision", 2)
    speech = make_team(db, "speech", 2)
    with db.transaction() as s:
        now = utcnow()
        s.add_all(
            Job(
                owner_id=owner[0],
                team_id=vision,
                name=f"flood{i}",
                status="queued",
                spec={"resources": {"node_count": 1, "process_count_per_node": 1}},
                architecture="resnet18",
                train_dataset_id=owner[1],
                validation_dataset_id=owner[1],
                node_count=1,
                process_count_per_node=1,
                created_at=now - timedelta(hours=1) + timedelta(milliseconds=i),
                updated_at=now,
            )
            for i in range(700)  # more than a pass reads of the one queue
        )
    late = team_job(db, owner, speech, 1, 1)
    run_pass(db, settings)
    assert status(db, late) == JobStatus.SCHEDULED


def test_a_team_gets_all_it_is_owed_back_in_one_pass(
    db: Database, settings: Settings, owner: tuple[str, str]
) -> None:
    nodes(db, owner, 4, 1)
    vision = make_team(db, "vision", 0)
    speech = make_team(db, "speech", 4)
    borrowed = [team_job(db, owner, vision, 1, 1) for _ in range(4)]
    run_pass(db, settings)
    start_running(db, *borrowed)
    wanted = [team_job(db, owner, speech, 1, 1) for _ in range(3)]
    run_pass(db, settings)
    # Three units owed, three jobs asked to stop at once (not one per checkpoint interval).
    assert sum(asked_to_stop(db, j) for j in borrowed) == 3
    assert all(status(db, j) == JobStatus.QUEUED for j in wanted)
