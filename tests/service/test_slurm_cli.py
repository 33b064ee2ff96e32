"""Slurm's commands as the Slurm engine runs them: every ``squeue`` and ``scancel`` is limited
to the Slurm user the API submits as, and a job another user submitted under a torchyard
job's name is neither listed nor found by name. Slurm's commands are stand-ins on ``PATH``
that record their arguments and answer as a cluster shared with another user would (the
real cluster: ``tests/e2e/test_slurm.py``)."""

from __future__ import annotations

import os
import pwd
import shlex
from pathlib import Path

import pytest

from service.engines.slurm_cli import Slurm, user_name

OTHER_UID = 65534  # nobody: another user of the cluster
NAME = "torchyard-job1-2"
# squeue's answer, whatever it was asked: a job of another user under a torchyard job's name
# first, then the API's own (a stand-in for a squeue that would not filter by user).
FAKE_SQUEUE = """#!/bin/sh
printf '%s\\n' "squeue $*" >> "$CALLS"
case "$*" in
  *'%i|%T|%U'*) printf '11|PENDING|%s\\n12|PENDING|%s\\n' "$OTHER" "$ME" ;;
  *) printf '11|{name}|PENDING|JobHeldUser|%s|\\n12|{name}|PENDING|Priority|%s|\\n' "$OTHER" "$ME" ;;
esac
""".replace("{name}", NAME)
FAKE_SCANCEL = """#!/bin/sh
printf '%s\\n' "scancel $*" >> "$CALLS"
"""


@pytest.fixture
def slurm(tmp_path: Path) -> tuple[Slurm, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("squeue", FAKE_SQUEUE), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "CALLS": str(calls),
        "OTHER": str(OTHER_UID),
        "ME": str(os.geteuid()),
    }
    return Slurm(env=env), calls


def _calls(path: Path) -> list[list[str]]:
    return [shlex.split(line) for line in path.read_text().splitlines()]


def test_every_query_and_cancel_is_limited_to_the_apis_slurm_user(slurm: tuple[Slurm, Path]) -> None:
    cli, calls = slurm
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert cli.uid == os.geteuid() and cli.user_filter == ["-u", me]
    cli.queue()
    cli.job_ids_named(NAME)
    cli.cancel("11")
    made = _calls(calls)
    assert [argv[0] for argv in made] == ["squeue", "squeue", "scancel"]
    for argv in made:
        assert argv[argv.index("-u") + 1] == me, argv
    assert made[0][:6] == ["squeue", "-h", "-t", "all", "-u", me]
    assert made[1][made[1].index("-n") + 1] == NAME


def test_another_users_job_of_the_same_name_is_not_seen(slurm: tuple[Slurm, Path]) -> None:
    """squeue answered with both users' jobs: only the API's user's are kept (``%U``)."""
    cli, _ = slurm
    assert list(cli.queue()) == ["12"]
    assert cli.queue()["12"].name == NAME and cli.queue()["12"].reason == "Priority"
    assert cli.job_ids_named(NAME) == ["12"]
    assert Slurm(env=cli.env, uid=OTHER_UID).job_ids_named(NAME) == ["11"]


def test_a_user_without_a_name_here_is_asked_for_with_me() -> None:
    """``-u`` takes a user name; a uid without one (a container's arbitrary uid) is ``--me``."""
    uid = next(u for u in range(4_000_000, 4_001_000) if user_name(u) is None)
    assert Slurm(uid=uid).user_filter == ["--me"]
    assert Slurm(uid=0).user_filter == ["-u", "root"]
