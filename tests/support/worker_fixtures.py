"""Helpers for scheduler, lease and worker tests: settling jobs directly in the database,
starting real worker agents (``torchyard worker`` subprocesses), uploading the digits
dataset through the API, and looking for a run's processes in the process table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from service.db.engine import Database
from service.db.models import Attempt, Checkpoint, Job, Placement
from service.db.types import utcnow
from service.services.jobs import transition
from service.states import FINAL_STATUSES, JobStatus
from tests.support.factories import auth

FINAL = frozenset(s.value for s in FINAL_STATUSES)


def finish_job(db: Database, job_id: str) -> None:
    """Settle a placed job as succeeded, as its agents would have: placements done, capacity freed."""
    now = utcnow()
    with db.transaction() as s:
        job = s.get_one(Job, job_id)
        for p in s.scalars(select(Placement).where(Placement.job_id == job_id)):
            p.status = "done"
            p.finished_at = now
        for a in s.scalars(select(Attempt).where(Attempt.job_id == job_id)):
            a.status = "succeeded"
            a.finished_at = now
        job.model_sha256 = "f" * 64
        if job.status == JobStatus.SCHEDULED.value:
            transition(s, job, JobStatus.RUNNING)
        transition(s, job, JobStatus.SUCCEEDED)


# --- datasets ---------------------------------------------------------------------------------


def _tar_gz(src: Path, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as tf:
        for path in sorted(src.rglob("*")):
            tf.add(path, arcname=str(path.relative_to(src)), recursive=False)
    return out


def upload_archive(client: httpx.Client, archive: Path, name: str) -> dict[str, Any]:
    """Upload a dataset archive through ``POST /v1/datasets``."""
    with open(archive, "rb") as fh:
        r = client.post("/v1/datasets", data={"name": name}, files={"file": (archive.name, fh)}, timeout=120)
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def upload_dataset(client: httpx.Client, folder: Path, name: str) -> dict[str, Any]:
    """Upload an image folder (as .tar.gz) through ``POST /v1/datasets``."""
    return upload_archive(client, _tar_gz(folder, folder.parent / f"{name}.tar.gz"), name)


# The digits archives written so far in this test process, by (per_class, size): written
# once (beside their train/ and val/ folders), uploaded to as many services as tests start.
_digits_archives: dict[tuple[int, int], tuple[Path, Path]] = {}


def upload_digits(
    client: httpx.Client, root: Path, *, per_class: int = 30, size: int = 32
) -> tuple[str, str]:
    """The scikit-learn digits as training and validation datasets of the service; their ids."""
    from torchyard.sample_data import write_digits

    archives = _digits_archives.get((per_class, size))
    if archives is None or not all(a.is_file() for a in archives):
        train_dir, val_dir = write_digits(root, per_class=per_class, size=size)
        archives = (
            _tar_gz(train_dir, root / "digits-train.tar.gz"),
            _tar_gz(val_dir, root / "digits-val.tar.gz"),
        )
        _digits_archives[(per_class, size)] = archives
    elif not root.exists():
        root.symlink_to(archives[0].parent, target_is_directory=True)  # the folders, as if written here
    train = upload_archive(client, archives[0], "digits-train")
    val = upload_archive(client, archives[1], "digits-val")
    return train["id"], val["id"]


# --- agents -----------------------------------------------------------------------------------


@dataclass
class AgentProcess:
    """A ``torchyard worker`` subprocess."""

    name: str
    work_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    _log: Any = field(repr=False, default=None)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def discard(self) -> None:
        """End of a test: SIGKILL (no drain to wait for; the launch guard stops any ranks)."""
        self.kill()
        if self._log is not None:
            self._log.close()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait (the agent stops its ranks first)."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)
        finally:
            if self._log is not None:
                self._log.close()


def start_agent(
    api_url: str,
    token: str,
    name: str,
    work_dir: Path,
    *,
    slots: int = 1,
    grace_period: float = 10.0,
    env: dict[str, str] | None = None,
    extra_args: Iterable[str] = (),
    wrap: Iterable[str] = (),
) -> AgentProcess:
    """Start an agent; ``wrap`` prefixes its command (``taskset -c 0``, ``ip netns exec NS``)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / f"agent-{name}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - closed by AgentProcess.stop
    cmd = [
        *wrap,
        sys.executable,
        "-m",
        "torchyard.cli",
        "worker",
        "--api",
        api_url,
        "--name",
        name,
        "--slots",
        str(slots),
        "--work-dir",
        str(work_dir),
        "--grace-period",
        str(grace_period),
        "--cpu",
        *extra_args,
    ]
    child_env = {**os.environ, "TORCHYARD_TOKEN": token, **(env or {})}
    process = subprocess.Popen(
        cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
    )
    return AgentProcess(name, work_dir, log_path, process, log)


class Backoff:
    """The pauses of a poll: 0.1 s at first, then half as long again each time, up to 0.5 s.

    The waits of the end-to-end tests poll the API (a job's GET is about 10 ms of CPU for
    the client and the server) or scan ``/proc`` for minutes while the machine's cores run
    the jobs; polling every 0.1 s throughout spent a tenth of a core per waiting test. What
    they wait for lasts longer than 0.5 s (a job's state, a process gone), so a change is
    still seen within half a second."""

    def __init__(self, first: float = 0.1, longest: float = 0.5) -> None:
        self.pause = first
        self.longest = longest

    def sleep(self) -> None:
        time.sleep(self.pause)
        self.pause = min(self.pause * 1.5, self.longest)


def wait_for_node(client: httpx.Client, name: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    backoff = Backoff()
    while time.monotonic() < deadline:
        nodes = {n["name"]: n for n in client.get("/v1/cluster").json()["nodes"]}
        if name in nodes and nodes[name]["status"] == "ready":
            return nodes[name]
        backoff.sleep()
    raise AssertionError(f"node {name} did not register within {timeout} s")


def wait_for_job(
    client: httpx.Client,
    job_id: str,
    predicate: Callable[[dict[str, Any]], bool] = lambda j: j["status"] in FINAL,
    *,
    timeout: float = 120,
    agents: Iterable[AgentProcess] = (),
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    backoff = Backoff()
    while True:
        try:
            r = client.get(f"/v1/jobs/{job_id}")
        except httpx.TransportError:
            # A keep-alive connection the server closed as it was reused: poll again.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        assert r.status_code == 200, r.text
        job: dict[str, Any] = r.json()
        if predicate(job):
            return job
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- agent {a.name} ---\n{a.log_text()[-6000:]}" for a in agents)
            raise AssertionError(f"job {job_id} is {job['status']} after {timeout} s: {job}\n{logs}")
        backoff.sleep()


def worker_token(admin: httpx.Client, name: str = "agents") -> str:
    r = admin.post("/v1/tokens", json={"name": name, "role": "worker"})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


def user_client(admin: httpx.Client, base_url: str, name: str = "alice") -> httpx.Client:
    r = admin.post("/v1/tokens", json={"name": name, "role": "user"})
    assert r.status_code == 201, r.text
    return httpx.Client(base_url=base_url, headers=auth(r.json()["token"]), timeout=60)


# --- the process table ------------------------------------------------------------------------


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of live processes whose command line or environment mentions ``text``."""
    needle = text.encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                cmdline = fh.read()
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[-1].split()[0]
        except OSError:
            continue
        if state == b"Z":
            continue  # a zombie is no longer running; its parent reaps it
        environ = b""
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            pass
        if needle in cmdline or needle in environ:
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def torchrun_and_rank_up(found: list[tuple[int, str]]) -> bool:
    """Whether a run's processes (:func:`processes_mentioning` its folder) include torchrun and
    a rank. (Not merely two processes of the run: a sandboxed run's two bwrap processes come
    first, and bwrap's monitor killed before its child has asked to die with it leaves that
    child running.)"""
    commands = [command for _, command in found]
    return any("torch.distributed.run" in c for c in commands) and any(
        "worker.trainer" in c for c in commands
    )


def wait_until_gone(text: str, timeout: float = 20) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    left = processes_mentioning(text)
    backoff = Backoff()
    while left and time.monotonic() < deadline:
        backoff.sleep()
        left = processes_mentioning(text)
    return left


def checkpoint_epoch(db_url: str, job_id: str) -> int:
    """The newest checkpoint of the job the API has stored (0 when there is none)."""
    db = Database(db_url)
    try:
        with db.read_session() as s:
            epoch = s.scalar(select(func.max(Checkpoint.epoch)).where(Checkpoint.job_id == job_id))
    finally:
        db.dispose()
    return int(epoch or 0)


def agent_log_of(run_dir: Path) -> Path:
    """The agent's own log of a placement whose run folder is ``run_dir`` (``<work dir>/runs/<run>``):
    it lies in ``<work dir>/placements/<run>/``, out of the run's reach."""
    return run_dir.parent.parent / "placements" / run_dir.name / "agent.log"
