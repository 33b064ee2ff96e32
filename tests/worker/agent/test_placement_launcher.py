"""The one-placement launcher (``torchyard launch``, docs/slurm.md): what an engine starts on a
compute node to run one placement of one attempt, with a launch token scoped to it.

The attempt is handed over here the way an engine does it (``launches.start_attempt``);
the launcher runs as a real process against a live API and runs a real script job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from service.db.engine import Database
from service.db.models import Job, Token
from service.services import launches
from tests.conftest import fast_leases
from tests.support.factories import auth
from tests.support.script_helpers import script_env
from worker.agent import guard
from worker.agent.placement_launcher import allocated_cpus
from worker.agent.rank_group import LaunchSpec, RankGroup, rank_env, visible_devices

PROBE = """
import json, os, sys
from torchyard.run import log_metric
out = os.environ["TORCHYARD_OUTPUT_DIR"]
seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHYARD_LAUNCH_TOKEN",
                                        "TORCHYARD_TOKEN")}
open(os.path.join(out, "seen.json"), "w").write(json.dumps(seen))
log_metric("probe", 1.0, step=1)
print("probe ran")
"""


def _hand_over(settings: Any, job_id: str) -> tuple[str, str]:
    """What an engine does at submission: an attempt without placements, and its launch token."""
    db = Database(settings.sqlalchemy_url)
    try:
        with db.session() as session:
            job = session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
            attempt, token = launches.start_attempt(session, job, "slurm", "handed to a test engine")
            session.commit()
            return attempt.id, token
    finally:
        db.dispose()


def _launch(url: str, attempt: str, token: str, work: Path, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TORCHYARD_"))}
    env["TORCHYARD_LAUNCH_TOKEN"] = token
    argv = [sys.executable, "-m", "worker.agent.placement_launcher", "--api", url, "--attempt", attempt]
    argv += ["--node", "ln1", "--node-rank", "0", "--nodes", "ln1", "--work-dir", str(work), *extra]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_visible_devices_keep_what_the_engine_gave() -> None:
    # Slurm gave this process GPU 1 only: its first visible GPU is GPU 1, not GPU 0.
    assert visible_devices((0,), "1") == "1"
    assert visible_devices((0, 1), "5,7") == "5,7"
    assert visible_devices((1,), "GPU-aaa,GPU-bbb") == "GPU-bbb"
    assert visible_devices((0, 1), None) == "0,1"


def test_rank_environment_keeps_the_inherited_gpus(tmp_path: Path) -> None:
    spec = LaunchSpec(
        run_dir=tmp_path, node_name="n1", node_rank=0, node_count=1, nproc=1, master_addr="a",
        master_port=1, cpus=2, gpu_ids=(0,),
    )  # fmt: skip
    env = rank_env(spec, {"CUDA_VISIBLE_DEVICES": "1", "TORCHYARD_LAUNCH_TOKEN": "secret"}, "m")
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["TORCHYARD_DEVICE"] == "cuda"
    assert "TORCHYARD_LAUNCH_TOKEN" not in env


def test_ranks_threads_follow_the_cpus_slurm_gave() -> None:
    assert allocated_cpus(8, {"SLURM_CPUS_ON_NODE": "2"}) == 2
    assert allocated_cpus(2, {"SLURM_CPUS_ON_NODE": "16"}) == 2  # never more than this process may use
    assert allocated_cpus(8, {}) == 8 and allocated_cpus(8, {"SLURM_CPUS_ON_NODE": "x"}) == 8
    # The Kubernetes engine's pod says it (its CPU request), ahead of anything Slurm left.
    assert allocated_cpus(8, {"TORCHYARD_LAUNCH_CPUS": "3", "SLURM_CPUS_ON_NODE": "6"}) == 3


# Under ``guard --shield``: a DataLoader worker (whose torch installs a SIGTERM handler of
# its own) and its rank say whether they ignore SIGTERM, then the rank waits to be signalled.
SHIELDED_RANK = """
import functools, signal, sys, time
import torch.utils.data as data
from worker.trainer.seeding import ignored_signals, init_loader_worker

def ignores_sigterm():  # the kernel's word (torch's workers set a C handler Python does not see)
    mask = next(line for line in open("/proc/self/status") if line.startswith("SigIgn:"))
    return int(mask.split()[1], 16) >> (signal.SIGTERM - 1) & 1

class Probe(data.Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, i):
        return ignores_sigterm()

init = functools.partial(init_loader_worker, ignored=ignored_signals())
(worker,) = data.DataLoader(Probe(), num_workers=1, worker_init_fn=init)
print(f"rank {ignores_sigterm()} worker {int(worker)}", flush=True)
time.sleep(0.5)
print("still here", flush=True)
"""


@pytest.mark.slow
def test_shielded_ranks_and_their_loader_workers_ignore_the_engines_sigterm() -> None:
    """Slurm signals every process of a job step: under ``guard --shield`` the rank and its
    loader workers ignore SIGTERM (the launcher alone turns it into a checkpoint request)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.agent.guard", guard.SHIELD, str(os.getpid()), sys.executable, "-c",
         SHIELDED_RANK],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.strip() == "rank 1 worker 1", first + proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "still here" in out, out


RANK_SLEEPS = """
import sys, time
open(sys.argv[1], "w").write("up")
time.sleep(600)
"""


@pytest.mark.slow
def test_a_shielded_torchrun_outlives_sigterm_and_stops_on_sigint(tmp_path: Path) -> None:
    """Real torchrun under ``guard --shield``: Slurm's SIGTERM to every process leaves it and
    its rank running; the launcher's stop (SIGINT) ends both at once, long before the grace."""
    run_dir = tmp_path / "work" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (tmp_path / "rank.py").write_text(RANK_SLEEPS)
    spec = LaunchSpec(
        run_dir=run_dir, node_name="n1", node_rank=0, node_count=1, nproc=1, master_addr="127.0.0.1",
        master_port=1, cpus=1, shielded=True,
    )  # fmt: skip
    group = RankGroup(spec)
    up = run_dir / "rank-up"
    group.command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                     str(tmp_path / "rank.py"), str(up)]  # fmt: skip
    with open(tmp_path / "torchrun.log", "w") as out:
        group.start(out)
    try:
        deadline = time.monotonic() + 120
        while not up.exists():
            assert group.poll() is None and time.monotonic() < deadline, (
                tmp_path / "torchrun.log"
            ).read_text()
            time.sleep(0.1)
        pids = group.alive_pids()
        assert len(pids) >= 2  # torchrun and its rank
        for pid in pids:
            os.kill(pid, signal.SIGTERM)  # what Slurm does at a preemption
        time.sleep(1)
        assert group.poll() is None and sorted(group.alive_pids()) == sorted(pids)
        started = time.monotonic()
        group.stop(grace=60)
        assert time.monotonic() - started < 30 and group.alive_pids() == []
        assert "sending SIGKILL" not in (tmp_path / "torchrun.log").read_text()
    finally:
        if group.poll() is None:
            group.stop(grace=1)


def test_shielded_rank_environment_keeps_torchrun_off_sigterm(tmp_path: Path) -> None:
    spec = LaunchSpec(
        run_dir=tmp_path, node_name="n1", node_rank=0, node_count=1, nproc=1, master_addr="a",
        master_port=1, cpus=2, shielded=True,
    )  # fmt: skip
    env = rank_env(spec, {}, "m")
    assert "SIGTERM" not in env["PET_SIGNALS_TO_HANDLE"] and "SIGINT" in env["PET_SIGNALS_TO_HANDLE"]
    assert spec.stop_signal == signal.SIGINT
    assert "PET_SIGNALS_TO_HANDLE" not in rank_env(
        LaunchSpec(**{**spec.__dict__, "shielded": False}), {}, "m"
    )


@pytest.mark.slow
def test_launcher_runs_one_placement_with_a_token_scoped_to_its_attempt(
    make_settings: Any, tmp_path: Path
) -> None:
    settings = make_settings(**fast_leases(ports=(27400, 27449)))
    with script_env(settings, tmp_path) as env:
        admin = httpx.Client(base_url=env.server.url, headers=auth(env.server.admin_token), timeout=30)
        worker = httpx.Client(base_url=env.server.url, headers=auth(env.token), timeout=30)
        # A node the limits count, drained so that no agent scheduling takes the job.
        r = worker.post("/v1/worker/nodes", json={"name": "ln1", "address": "127.0.0.1", "units": 1,
                                                  "accelerator": "cpu", "info": {}})  # fmt: skip
        assert r.status_code == 200, r.text
        assert admin.post("/v1/cluster/nodes/ln1/drain").status_code == 200
        code = env.upload_code({"probe.py": PROBE})
        job_id = env.submit(code, ["python", "probe.py"])
        attempt_id, token = _hand_over(settings, job_id)
        other_job = env.submit(code, ["python", "probe.py"])
        other_attempt, _ = _hand_over(settings, other_job)

        launcher = httpx.Client(base_url=env.server.url, headers=auth(token), timeout=30)
        # The launch token speaks for its attempt only: no node routes, no other attempt.
        body = {"name": "ln9", "address": "127.0.0.1", "units": 1, "accelerator": "cpu", "info": {}}
        assert launcher.post("/v1/worker/nodes", json=body).status_code == 403
        assert launcher.post("/v1/worker/nodes/ln1/claim").status_code == 403
        check = {"node": "ln1", "node_rank": 0, "nodes": ["ln1"], "address": "127.0.0.1"}
        denied = launcher.post(f"/v1/worker/attempts/{other_attempt}/check-in", json=check)
        assert denied.status_code == 403, denied.text
        assert launcher.get("/v1/jobs").status_code == 403
        # A worker token is no launch token.
        assert worker.post(f"/v1/worker/attempts/{attempt_id}/check-in", json=check).status_code == 403
        # Launch tokens are the attempts', not the admin's list.
        names = [t["name"] for t in admin.get("/v1/tokens").json()["items"]]
        assert not any(n.startswith("launch ") for n in names)

        started = time.monotonic()
        proc = _launch(env.server.url, attempt_id, token, tmp_path / "work")
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        job = env.wait(job_id, timeout=60)
        assert job["status"] == "succeeded", (job, out)
        assert time.monotonic() - started < 180
        seen = json.loads(env.outputs(job_id)["seen.json"])
        assert seen["RANK"] == "0" and seen["WORLD_SIZE"] == "1" and seen["MASTER_ADDR"] == "127.0.0.1"
        assert seen["TORCHYARD_LAUNCH_TOKEN"] is None and seen["TORCHYARD_TOKEN"] is None
        assert "probe ran" in env.log(job_id, rank=0)
        points = env.user.get(f"/v1/jobs/{job_id}/metrics", params={"name": "probe"}).json()["items"]
        assert [p["value"] for p in points] == [1.0]
        (attempt,) = job["attempts"]
        assert attempt["nodes"] == ["ln1"] and attempt["status"] == "succeeded"

        # The placement is taken: a second launcher of the same rank runs nothing.
        again = launcher.post(f"/v1/worker/attempts/{attempt_id}/check-in", json=check)
        assert again.status_code == 409, again.text
        # The other attempt's launcher, cancelled before it checked in, exits without running.
        assert env.user.post(f"/v1/jobs/{other_job}/cancel").status_code == 200
        db = Database(settings.sqlalchemy_url)
        try:
            with db.read_session() as session:
                tokens = session.scalars(select(Token).where(Token.attempt_id == other_attempt)).all()
                assert len(tokens) == 1 and tokens[0].role == "worker"
        finally:
            db.dispose()
        admin.close()
        worker.close()
        launcher.close()
