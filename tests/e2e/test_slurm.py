"""The Slurm engine (docs/slurm.md) on a real Slurm cluster: Debian's slurmctld, slurmd and munge,
two nodes in network namespaces (:mod:`tests.support.slurm_cluster`), the API as a real
``torchyard serve`` with ``TORCHYARD_ENGINE=slurm``, the launcher started by ``srun``.

One cluster and one API for the whole module; the tests run in order and each leaves
Slurm's queue empty of its jobs. Workloads are the smallest that show the behaviour:
digits at 16 px for 2 epochs, or scripts that only print."""

from __future__ import annotations

import os
import pwd
import shutil
import sqlite3
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api_process import ApiProcess
from tests.support.engine_env import MODEL, PARAMETERS, EngineEnv, write_launcher
from tests.support.factories import auth
from tests.support.slurm_cluster import SlurmCluster, require_slurm
from tests.support.worker_fixtures import agent_log_of, upload_digits, user_client
from worker.trainer.control import PREEMPT_REQUEST_FILE

pytestmark = [pytest.mark.slow]


@dataclass
class SlurmEnv(EngineEnv):
    cluster: SlurmCluster | None = None
    launcher: Path | None = None

    def outputs(self) -> str:
        parts = []
        for path in sorted((self.api.data_dir / "slurm").glob("*.out"))[-4:]:
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def top1(self, job_id: str) -> dict[int, float]:
        r = self.user.get(f"/v1/jobs/{job_id}/metrics", params={"name": "val.top1", "limit": 1000})
        assert r.status_code == 200, r.text
        return {p["epoch"]: p["value"] for p in r.json()["items"]}

    def slurm_jobs(self, job_id: str) -> list[dict[str, str]]:
        """Slurm's jobs of one torchyard job that still pend or run."""
        return self.cluster.active(f"torchyard-{job_id}-")

    def wait_slurm_empty(self, job_id: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.slurm_jobs(job_id):
            assert time.monotonic() < deadline, (self.slurm_jobs(job_id), self.api.log()[-3000:])
            time.sleep(0.2)

    def fill(self, partition: str = "low", seconds: int = 120) -> str:
        """An outside job taking every GPU of both nodes."""
        out = self.cluster.command(
            "sbatch", "--parsable", "-p", partition, "-N", "2", "--gres=gpu:2", "-J", "outside",
            f"--output={self.cluster.root}/outside-%j.out", "--wrap", f"sleep {seconds}",
        )  # fmt: skip
        job_id = out.strip()
        deadline = time.monotonic() + 20
        while self.cluster.squeue()[-1]["state"] != "RUNNING" and partition == "low":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        return job_id


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmEnv]:
    require_slurm()
    root = tmp_path_factory.mktemp("slurm")
    started = time.monotonic()
    cluster = SlurmCluster(root=root / "cluster").start()
    up = time.monotonic() - started
    launcher = write_launcher(root)
    api = ApiProcess(
        root / "data",
        None,
        host=cluster.gateway,
        settings={
            "TORCHYARD_ENGINE": "slurm",
            "TORCHYARD_SLURM_PARTITIONS": "low",
            "TORCHYARD_SLURM_LAUNCHER": str(launcher),
            "TORCHYARD_SLURM_POLL_S": "0.5",
            "TORCHYARD_SLURM_WORK_DIR": str(root / "nodes"),
            "TORCHYARD_PREEMPT_GRACE_S": "20",
            "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
            "TORCHYARD_LEASE_TIMEOUT_S": "4",
            "TORCHYARD_REAPER_INTERVAL_S": "0.2",
            "TORCHYARD_MASTER_PORT_MIN": "27500",
            "TORCHYARD_MASTER_PORT_MAX": "27599",
            "SLURM_CONF": str(cluster.conf),
        },
    )
    api.env["TORCHYARD_SLURM_API_URL"] = api.url
    try:
        api.start().wait_ready()
        admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60)
        user = user_client(admin, api.url)
        digits = upload_digits(user, root / "digits", per_class=12, size=16)
        env = SlurmEnv(api, user, digits, root, cluster=cluster, launcher=launcher)
        deadline = time.monotonic() + 60  # the engine's first inventory of the cluster
        while user.get("/v1/cluster").json()["ready_nodes"] != 2:
            assert time.monotonic() < deadline, api.log()[-4000:]
            time.sleep(0.1)
        print(f"Slurm cluster up in {up:.2f} s", file=sys.stderr)
        yield env
        user.close()
        admin.close()
    finally:
        api.kill()
        started = time.monotonic()
        cluster.close()
        print(f"Slurm cluster down in {time.monotonic() - started:.2f} s", file=sys.stderr)


def test_cluster_lists_the_slurm_nodes_with_their_units(slurm: SlurmEnv) -> None:
    deadline = time.monotonic() + 10
    while True:
        cluster = slurm.user.get("/v1/cluster").json()
        if cluster["ready_nodes"] == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert cluster["engine"] == "slurm" and cluster["max_nodes"] == 2
    nodes = {n["name"]: n for n in cluster["nodes"]}
    assert sorted(nodes) == ["n1", "n2"]
    for name, node in nodes.items():
        assert node["engine"] == "slurm" and node["status"] == "ready"
        assert node["units"] == 2 and node["accelerator"] == "gpu"  # the gres column: gpu:2
        assert node["address"] == slurm.cluster.node(name).address


def test_a_job_larger_than_any_partition_is_refused(slurm: SlurmEnv) -> None:
    train, val = slurm.digits
    for resources, field in (
        ({"node_count": 3, "process_count_per_node": 1}, "resources.node_count"),
        ({"node_count": 1, "process_count_per_node": 3}, "resources.process_count_per_node"),
    ):
        body = {"model": MODEL, "train_dataset": train, "validation_dataset": val,
                "parameters": PARAMETERS, "resources": resources}  # fmt: skip
        r = slurm.user.post("/v1/jobs", json=body)
        assert r.status_code == 422, r.text
        assert r.json()["code"] == "ResourceLimitError" and field in r.text
    assert slurm.cluster.active("torchyard-") == []


def test_two_node_training_job_succeeds_on_both_nodes(slurm: SlurmEnv) -> None:
    _two_node_reference(slurm)


def _two_node_reference(slurm: SlurmEnv) -> dict[tuple[str, int], float]:
    """The uninterrupted 2-node run, checked; its metrics are the preemption test's
    reference (run once per module; again only where that test runs without it)."""
    if slurm.reference is not None:
        return slurm.reference
    job_id = slurm.train(nodes=2)
    job = slurm.wait(job_id, timeout=120)
    assert job["status"] == "succeeded", job
    (attempt,) = job["attempts"]
    assert sorted(attempt["nodes"]) == ["n1", "n2"] and attempt["engine"] == "slurm"
    assert (
        attempt["engine_job_id"] and attempt["master_addr"] == slurm.cluster.node(attempt["nodes"][0]).address
    )
    slurm.reference = slurm.history(job_id)
    assert sorted(k for k in slurm.reference if k[0] != "train.loss") == [
        ("val.loss", 1), ("val.loss", 2), ("val.top1", 1), ("val.top1", 2)
    ]  # fmt: skip
    assert len([k for k in slurm.reference if k[0] == "train.loss"]) == 6  # 3 steps an epoch
    assert slurm.user.get(f"/v1/jobs/{job_id}/model").status_code == 200
    slurm.wait_slurm_empty(job_id)
    return slurm.reference


def test_pending_reasons_cancel_outside_scancel_and_api_restart(slurm: SlurmEnv) -> None:
    outside = slurm.fill()
    first = slurm.script(["python", "probe.py"])
    second = slurm.script(["python", "probe.py"])
    slurm.wait(first, lambda j: "Resources" in (j.get("reason") or ""), timeout=30)
    job = slurm.wait(second, lambda j: "Priority" in (j.get("reason") or ""), timeout=30)
    assert job["status"] == "scheduled" and job["reason"].startswith("waiting in Slurm (job ")

    # Cancel while pending: cancelled, and nothing of it left in Slurm.
    assert slurm.user.post(f"/v1/jobs/{first}/cancel").status_code == 200
    assert slurm.wait(first)["status"] == "cancelled"
    slurm.wait_slurm_empty(first)

    # scancel from outside torchyard: cancelled, not submitted again.
    (pending,) = slurm.slurm_jobs(second)
    slurm.cluster.command("scancel", pending["id"])
    job = slurm.wait(second)
    assert job["status"] == "cancelled" and len(job["attempts"]) == 1, job

    # The API stops after sbatch but before it recorded the Slurm job: nothing is submitted twice.
    third = slurm.script(["python", "probe.py"])
    job = slurm.wait(third, lambda j: bool(j["attempts"] and j["attempts"][0]["engine_job_id"]), timeout=30)
    slurm_id = job["attempts"][0]["engine_job_id"]
    slurm.api.kill()
    with sqlite3.connect(slurm.api.data_dir / "torchyard.db") as db:
        db.execute("UPDATE attempts SET engine_job_id = NULL WHERE job_id = ?", (third,))
    slurm.api.start().wait_ready()
    job = slurm.wait(third, lambda j: j["attempts"][0]["engine_job_id"] is not None, timeout=30)
    assert job["attempts"][0]["engine_job_id"] == slurm_id
    # The adopting pass wrote "submitted"; a later poll reads Slurm's reason again.
    slurm.wait(third, lambda j: not (j.get("reason") or "").endswith(": submitted"), timeout=30)
    assert [j["id"] for j in slurm.cluster.squeue(f"torchyard-{third}-1")] == [slurm_id]
    assert slurm.user.post(f"/v1/jobs/{third}/cancel").status_code == 200
    assert slurm.wait(third)["status"] == "cancelled"
    slurm.cluster.command("scancel", outside)
    slurm.wait_slurm_empty(third)


def test_another_users_job_under_a_torchyard_name_is_never_adopted(slurm: SlurmEnv) -> None:
    """Another user of the cluster (``nobody``) submits a job named as a torchyard attempt
    while the API is down between its commit and ``sbatch``: the restarted API submits its
    own job, and never adopts, polls or cancels the other user's."""
    outside = slurm.fill()  # the nodes are busy: the jobs below stay pending
    job_id = slurm.script(["python", "probe.py"])
    job = slurm.wait(job_id, lambda j: bool(j["attempts"] and j["attempts"][0]["engine_job_id"]), timeout=30)
    first = job["attempts"][0]["engine_job_id"]
    name = f"torchyard-{job_id}-1"
    slurm.api.kill()
    # As if the API had stopped before its sbatch: no job of its own has the name...
    slurm.cluster.command("scontrol", "update", f"jobid={first}", f"jobname=renamed-{job_id}")
    with sqlite3.connect(slurm.api.data_dir / "torchyard.db") as db:
        db.execute("UPDATE attempts SET engine_job_id = NULL WHERE job_id = ?", (job_id,))
    # ...and another user's job (held: it never runs) has it.
    foreign = slurm.cluster.command(
        "sbatch", "--parsable", "--uid=nobody", "--hold", "-J", name, "--output=/dev/null",
        "--wrap", "sleep 600",
    ).strip()  # fmt: skip
    try:
        slurm.api.start().wait_ready()
        job = slurm.wait(job_id, lambda j: j["attempts"][0]["engine_job_id"] is not None, timeout=30)
        ours = job["attempts"][0]["engine_job_id"]
        assert ours not in (foreign, first), (ours, foreign, first)
        users = dict(
            line.split("|", 1)
            for line in slurm.cluster.command("squeue", "-h", "-t", "all", "-n", name, "-o", "%i|%u").split()
        )
        assert users == {foreign: "nobody", ours: pwd.getpwuid(os.geteuid()).pw_name}, users
        assert slurm.user.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        assert slurm.wait(job_id)["status"] == "cancelled"
        deadline = time.monotonic() + 30
        while any(j["id"] == ours for j in slurm.slurm_jobs(job_id)):
            assert time.monotonic() < deadline, slurm.slurm_jobs(job_id)
            time.sleep(0.2)
        # The other user's job was left alone: still pending, held.
        assert [(j["id"], j["state"]) for j in slurm.slurm_jobs(job_id)] == [(foreign, "PENDING")]
    finally:
        slurm.cluster.command("scancel", foreign, first, outside, check=False)
    slurm.wait_slurm_empty(job_id)


def test_cancel_while_running_leaves_no_slurm_job_and_no_process(slurm: SlurmEnv) -> None:
    job_id = slurm.script(["python", "probe.py", "600"])
    job = slurm.wait(job_id, lambda j: j["status"] == "running", timeout=60)
    attempt = job["attempts"][0]["id"]
    assert slurm.user.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert slurm.wait(job_id, timeout=60)["status"] == "cancelled"
    slurm.wait_slurm_empty(job_id)
    deadline = time.monotonic() + 20
    while _processes_with(attempt) or _processes_with("probe.py 600"):
        assert time.monotonic() < deadline, _processes_with(attempt)
        time.sleep(0.2)


def test_script_jobs_in_both_launch_modes(slurm: SlurmEnv) -> None:
    per_process = slurm.script(["python", "probe.py", "barrier"], nodes=2, launch="per_process")
    per_node = slurm.script(["python", "probe.py", "barrier"], nodes=2, launch="per_node")
    for job_id, wanted in ((per_process, "RANK=1 WORLD_SIZE=2"), (per_node, "NNODES=2 NPROC_PER_NODE=1")):
        job = slurm.wait(job_id, timeout=90)
        assert job["status"] == "succeeded", job
        # Node rank 0's success ends the job; node rank 1's last lines may arrive just after.
        deadline = time.monotonic() + 30
        while wanted not in (logs := slurm.user.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1}).text):
            assert time.monotonic() < deadline, logs
            time.sleep(0.2)
        assert "NODE_RANK=1" in logs, logs
        slurm.wait_slurm_empty(job_id)


def test_preemption_by_a_higher_priority_partition_resumes_exactly(slurm: SlurmEnv) -> None:
    """A ``high`` job needs the GPUs of the running two-node job: Slurm preempts it (SIGTERM,
    SIGKILL after the partition's GraceTime), the ranks checkpoint mid-epoch and the attempt is
    ``preempted`` (no restart counted); torchyard submits it again and it resumes exactly:
    the same per-epoch validation metrics as the uninterrupted two-node run's."""
    reference = _two_node_reference(slurm)
    # Rank 0 waits half-way through epoch 2 until the preemption is under way, so the
    # signal lands mid-epoch however slow the machine is; the next attempt does not wait.
    with slurm.launch_env(TORCHYARD_TEST_PAUSE_AT="train:2"):
        job_id = slurm.train(nodes=2)
        paused = slurm.wait_file(job_id, 1, "paused-train-2")
    first_run = paused.parent
    slurm.fill(partition="high", seconds=1)
    slurm.wait_file(job_id, 1, PREEMPT_REQUEST_FILE)
    paused.unlink()
    slurm.assert_preempted_then_resumed_exactly(job_id, first_run, reference, timeout=120)
    assert (
        "resuming from it"
        in agent_log_of(slurm.run_dir(job_id, 2, first_run.name.rsplit("-", 1)[1])).read_text()
    )
    slurm.wait_slurm_empty(job_id)


def test_wrong_launcher_path_is_an_engine_error_not_retried(slurm: SlurmEnv) -> None:
    hidden = slurm.launcher.with_suffix(".moved")
    shutil.move(slurm.launcher, hidden)
    try:
        job_id = slurm.script(["python", "probe.py"])
        job = slurm.wait(job_id, timeout=60)
    finally:
        shutil.move(hidden, slurm.launcher)
    assert job["status"] == "failed" and job["failure"]["code"] == "EngineError", job
    assert str(slurm.launcher) in job["failure"]["message"] and "No such file" in job["failure"]["message"]
    assert len(job["attempts"]) == 1


def test_a_node_cut_off_is_worker_lost_and_the_job_resumes(slurm: SlurmEnv) -> None:
    """The node of a one-node job loses its link half-way through epoch 2: its lease runs
    out (``WorkerLostError`` naming it), Slurm marks it down, and the job restarts on the
    other node from the epoch-1 checkpoint."""
    with slurm.launch_env(TORCHYARD_TEST_PAUSE_AT="train:2"):
        job_id = slurm.train(nodes=1)
        paused = slurm.wait_file(job_id, 1, "paused-train-2")
    node = paused.parent.name.rsplit("-", 1)[1]
    _wait_for_text(agent_log_of(paused.parent), "checkpoint of epoch 1 uploaded")
    # Epoch 1's metrics reach the API in the launcher's next report batch, which a loaded
    # machine may send after the checkpoint: the link is cut once they are in.
    deadline = time.monotonic() + 60
    while 1 not in slurm.top1(job_id):
        assert time.monotonic() < deadline, slurm.api.log()[-3000:]
        time.sleep(0.2)
    slurm.cluster.link(node, up=False)
    try:
        job = slurm.wait(job_id, lambda j: len(j["attempts"]) >= 2, timeout=60)
        first = job["attempts"][0]
        assert first["end_reason"]["code"] == "WorkerLostError" and node in first["end_reason"]["message"], (
            first
        )
        job = slurm.wait(job_id, timeout=90)
    finally:
        paused.unlink(missing_ok=True)
        slurm.cluster.link(node, up=True)
        slurm.cluster.resume(node)
    assert job["status"] == "succeeded" and job["restarts"] == 1, _attempts_of(job)
    # Slurm may place the restart on the cut node before it marks the node down: that attempt
    # ends NODE_FAIL before its launcher starts and is released (no restart counted).
    last = job["attempts"][-1]
    for between in job["attempts"][1:-1]:
        assert between["status"] == "preempted" and "lost a node before its launcher started" in (
            between["failure_message"] or ""
        ), _attempts_of(job)
    (other,) = last["nodes"]
    assert other != node
    assert "resuming from it" in agent_log_of(slurm.run_dir(job_id, last["number"], other)).read_text()
    assert sorted(slurm.top1(job_id)) == [1, 2]


def _attempts_of(job: dict[str, Any]) -> str:
    """A failed job's message: how each attempt ended, and the job's failure."""
    lines = [
        f"attempt {a['number']} on {a.get('nodes')}: {a['status']} {a.get('failure_code')} "
        f"{(a.get('failure_message') or '')[:400]}"
        for a in job["attempts"]
    ]
    return "\n".join([f"job {job['status']}: {job.get('failure')}", *lines])


def _wait_for_text(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and text in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.1)


def _processes_with(text: str) -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{entry.name}: {cmd}")
    return found
