"""Slurm's commands answered from what a real Slurm printed (``tests/service/engines/recorded/``,
whose README says how it was recorded): :class:`RecordedSlurm` is a
:class:`~service.engines.slurm_cli.Slurm` that runs nothing, answers each command line from
a recording and keeps every command and environment it was given. Used by
``tests/service/engines/test_slurm_driver.py``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.config import Settings
from service.engines.base import LaunchRequest
from service.engines.slurm import SlurmDriver
from service.engines.slurm_cli import Slurm, SlurmCommandError, user_name

RECORDED = Path(__file__).parents[1] / "service" / "engines" / "recorded"
API = "http://api:8000"
ME = user_name(os.geteuid())
USER_FILTER = ("-u", ME) if ME else ("--me",)
SINFO = ("sinfo", "-h", "-N", "-o", "%N|%t|%G|%c|%o|%P")
SQUEUE = ("squeue", "-h", "-t", "all", *USER_FILTER, "-o", "%i|%j|%T|%r|%U|%N")
# The environment Slurm's commands get (Slurm's own is made from the API's: _clean_env).
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/home/torchyard", "SLURM_CONF": "/etc/slurm/slurm.conf"}
NOT_ANSWERING = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"


def squeue_named(name: str) -> tuple[str, ...]:
    return ("squeue", "-h", "-t", "all", *USER_FILTER, "-n", name, "-o", "%i|%T|%U")


def show_job(job_id: str) -> tuple[str, ...]:
    return ("scontrol", "-o", "show", "job", job_id)


def show_partition(name: str) -> tuple[str, ...]:
    return ("scontrol", "-o", "show", "partition", name)


def recorded(name: str, outputs: Path | None = None) -> str:
    """A recorded answer, its placeholders filled in for this test process."""
    text = (RECORDED / name).read_text(encoding="utf-8")
    text = text.replace("@OTHER_UID@", str(os.geteuid() + 1)).replace("@UID@", str(os.geteuid()))
    text = text.replace("@USER@", ME or str(os.geteuid()))
    return text.replace("@OUTPUTS@", str(outputs)) if outputs is not None else text


@dataclass(frozen=True)
class Reply:
    stdout: str = ""
    code: int = 0
    stderr: str = ""


@dataclass
class RecordedSlurm(Slurm):
    """Slurm's commands answered from recordings, by exact command line (``sbatch``: any).

    Fails the test on a command nothing was recorded for. As :meth:`Slurm.run` does, a
    timeout (124) or a missing command (127) always raises, another failure only when
    checked; every call is kept with its environment."""

    replies: dict[tuple[str, ...], Reply] = field(default_factory=dict)
    calls: list[tuple[list[str], dict[str, str]]] = field(default_factory=list)

    def answer(self, argv: tuple[str, ...], reply: Reply | str) -> None:
        self.replies[argv] = Reply(reply) if isinstance(reply, str) else reply

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> str:
        self.calls.append((list(argv), dict(env if env is not None else self.env)))
        key = ("sbatch",) if argv[0] == "sbatch" else tuple(argv)
        reply = self.replies.get(key)
        if reply is None:
            raise AssertionError(f"nothing recorded for {shlex.join(argv)}")
        if reply.code in (124, 127) or (check and reply.code != 0):
            raise SlurmCommandError(argv, reply.code, reply.stderr or reply.stdout)
        return reply.stdout

    @property
    def argvs(self) -> list[list[str]]:
        return [argv for argv, _ in self.calls]

    def sbatch_calls(self) -> list[tuple[list[str], dict[str, str]]]:
        return [(argv, env) for argv, env in self.calls if argv[0] == "sbatch"]


def recorded_cluster(outputs: Path, sinfo: str = "sinfo-idle.txt") -> RecordedSlurm:
    """The tests' two-node cluster as recorded (``sinfo``: the nodes' state)."""
    slurm = RecordedSlurm(env=CLEAN_ENV)
    slurm.answer(SINFO, recorded(sinfo))
    slurm.answer((*SINFO, "-p", "low,high"), recorded(sinfo))
    slurm.answer((*SINFO, "-p", "low"), recorded("sinfo-low.txt"))
    slurm.answer(("sinfo", "-h", "-o", "%P"), recorded("sinfo-default-partition.txt"))
    slurm.answer(show_partition("low"), recorded("partition-low.txt"))
    slurm.answer(show_partition("high"), recorded("partition-high.txt"))
    slurm.answer(SQUEUE, recorded("squeue.txt"))
    for job_id, name in [
        ("3", "job-timeout.txt"),
        ("4", "job-completed.txt"),
        ("5", "job-failed.txt"),
        ("6", "job-cancelled.txt"),
        ("7", "job-preempted.txt"),
        ("10", "job-pending-resources.txt"),
        ("11", "job-pending-priority.txt"),
    ]:
        slurm.answer(show_job(job_id), recorded(name, outputs))
    slurm.answer(("scancel", *USER_FILTER, "6"), "")
    slurm.answer(("scancel", *USER_FILTER, "99999"), Reply(code=1, stderr=recorded("scancel-unknown.stderr")))
    return slurm


def gpu_cluster() -> RecordedSlurm:
    """Two A100 nodes (crafted: see recorded/README.md)."""
    slurm = RecordedSlurm(env=CLEAN_ENV)
    slurm.answer((*SINFO, "-p", "gpu"), recorded("crafted/sinfo-gpu-cluster.txt"))
    slurm.answer(SINFO, recorded("crafted/sinfo-gpu-cluster.txt"))
    slurm.answer(show_partition("gpu"), recorded("crafted/partition-gpu.txt"))
    return slurm


def settings_for(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "engine": "slurm",
        "slurm_api_url": API,
        "slurm_partitions": "low,high",
    }
    return Settings(**{**values, **overrides})


def started(
    tmp_path: Path, slurm: RecordedSlurm | None = None, **overrides: Any
) -> tuple[SlurmDriver, RecordedSlurm]:
    """A driver started on the recorded cluster, its calls so far forgotten."""
    settings = settings_for(tmp_path, **overrides)
    slurm = slurm if slurm is not None else recorded_cluster(settings.slurm_outputs)
    driver = SlurmDriver(settings, slurm=slurm)
    driver.start()
    slurm.calls.clear()
    return driver, slurm


def request(**overrides: Any) -> LaunchRequest:
    values: dict[str, Any] = {
        "job_id": "j1",
        "attempt_id": "a1",
        "attempt_number": 1,
        "node_count": 2,
        "process_count_per_node": 1,
        "launch_token": "launch-secret",
    }
    return LaunchRequest(**{**values, **overrides})
