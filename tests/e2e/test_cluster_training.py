"""Multi-node training with real processes: uvicorn + several ``torchyard worker`` agents +
torchrun (gloo) + the trainer, on digits uploaded through the API (resnet18 at 32 px).

* two agents on this machine as two nodes: a 2-node × 1-process job trains and its
  metrics equal a 1-node × 2-process job's with the same seed (world size 2 both);
* the same 2 × 1 job with each agent in its own network namespace (a separate "host"
  with its own address; the API on the gateway address): nothing may assume loopback;
* a rank failing on one node: the ranks of the other node stop, and the job's failure is
  the root cause (rank, node, traceback), not its echo on the other node;
* a node killed mid-job (its agent and ranks SIGKILLed): the ranks on the other node
  stop and the job fails with ``WorkerLostError`` naming the lost node.

(Cancel of a multi-node job is checked at the protocol level in tests/service/test_cluster_gang.py.)

Each agent of a 1-process node is pinned to its own CPU (``taskset``), as a separate
machine would be; that also gives every rank of both jobs one compute thread, so the
two runs do the same arithmetic.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import LiveServer, fast_leases
from tests.support.factories import auth, job_spec
from tests.support.netns import NetnsCluster, require_netns
from tests.support.worker_fixtures import (
    AgentProcess,
    processes_mentioning,
    start_agent,
    upload_digits,
    user_client,
    wait_for_job,
    wait_for_node,
    wait_until_gone,
    worker_token,
)

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.5
# Generous where no node is meant to be lost: the tests share two cores with torchrun.
LEASE_TIMEOUT_S = 10.0
# Where a node is killed on purpose: the API gives up on it after this long.
SHORT_LEASE_TIMEOUT_S = 6.0
LEARNING_RATE = 0.01
PARAMETERS = {
    "epochs": 2,
    "batch_size": 8,
    "image_size": 32,
    "augmentation": "none",
    "learning_rate": LEARNING_RATE,
    "random_seed": 7,
    "print_frequency": 5,
}


def _cluster_settings(make_settings: Any, **overrides: Any) -> Settings:
    values = fast_leases(heartbeat_s=HEARTBEAT_S, lease_s=LEASE_TIMEOUT_S, ports=(22000, 22499))
    values.update(overrides)
    settings: Settings = make_settings(**values)
    return settings


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    return _cluster_settings(make_settings)


def _pin(cpu: int) -> list[str]:
    """``taskset -c N``: one CPU per 1-process node (nothing where taskset or the CPU is missing)."""
    if shutil.which("taskset") is None or cpu not in os.sched_getaffinity(0):
        return []
    return ["taskset", "-c", str(cpu)]


@dataclass
class Env:
    server: LiveServer
    user: httpx.Client
    token: str
    train: str
    val: str
    tmp: Path
    agents: list[AgentProcess] = field(default_factory=list)

    def agent(self, name: str, *, slots: int, wrap: list[str] | None = None, **kw: Any) -> AgentProcess:
        agent = start_agent(
            self.server.url, self.token, name, self.tmp / name, slots=slots, wrap=wrap or [], **kw
        )
        self.agents.append(agent)
        return agent

    def ready(self, *names: str, timeout: float = 60) -> None:
        for name in names:
            wait_for_node(self.user, name, timeout=timeout)

    def submit(self, nodes: int, ppn: int, max_restarts: int = 0, **parameters: Any) -> str:
        spec = job_spec(
            self.train,
            self.val,
            name=f"digits-{nodes}x{ppn}",
            parameters={**PARAMETERS, **parameters},
            # No restarts unless a test asks: a lost node fails the job, as these tests check.
            resources={"node_count": nodes, "process_count_per_node": ppn, "max_restarts": max_restarts},
        )
        r = self.user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        return job_id

    def wait(self, job_id: str, predicate: Any = None, timeout: float = 240) -> dict[str, Any]:
        if predicate is None:
            return wait_for_job(self.user, job_id, timeout=timeout, agents=self.agents)
        return wait_for_job(self.user, job_id, predicate, timeout=timeout, agents=self.agents)

    def metric(self, job_id: str, name: str) -> list[dict[str, Any]]:
        r = self.user.get(f"/v1/jobs/{job_id}/metrics", params={"name": name, "limit": 10000})
        assert r.status_code == 200, r.text
        items: list[dict[str, Any]] = r.json()["items"]
        return items

    def log(self, job_id: str, **params: Any) -> str:
        r = self.user.get(f"/v1/jobs/{job_id}/logs", params=params)
        assert r.status_code == 200, r.text
        return r.text


@contextlib.contextmanager
def open_env(settings: Settings, tmp_path: Path, host: str = "127.0.0.1") -> Iterator[Env]:
    """A live API on ``host``, a user with the digits uploaded, and a worker token; agents
    started through the env are stopped at the end."""
    server = LiveServer(settings, host=host).start()
    admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=60)
    user = user_client(admin, server.url)
    env = Env(server, user, worker_token(admin), "", "", tmp_path)
    try:
        env.train, env.val = upload_digits(user, tmp_path / "digits", per_class=20, size=32)
        yield env
    finally:
        for agent in env.agents:
            agent.discard()
        user.close()
        admin.close()
        server.stop()


@pytest.fixture
def env(settings: Settings, tmp_path: Path) -> Iterator[Env]:
    with open_env(settings, tmp_path) as e:
        yield e


def _by_epoch(points: list[dict[str, Any]]) -> dict[int, float]:
    return {p["epoch"]: p["value"] for p in points}


def _series(points: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(epoch, step, value) of a metric's points, in order."""
    return sorted((p["epoch"], p["step"], p["value"]) for p in points)


def _placements(job: dict[str, Any]) -> dict[int, str]:
    """node rank → node name, of the job's latest attempt."""
    return {p["node_rank"]: p["node"] for p in job["attempts"][-1]["placements"]}


def _check_two_node_run(env: Env, job: dict[str, Any], node_names: set[str]) -> None:
    assert job["status"] == "succeeded", job
    placed = _placements(job)
    assert set(placed) == {0, 1} and set(placed.values()) == node_names
    # Per-rank logs for both ranks: rank 0 on node rank 0, rank 1 on node rank 1.
    rank0, rank1 = env.log(job["id"], rank=0), env.log(job["id"], rank=1)
    assert rank0.strip() and rank1.strip()
    # The effective learning rate is learning_rate × world size (2 nodes × 1 process).
    assert f"effective lr {LEARNING_RATE * 2:g} on 2 process(es)" in rank0
    lrs = [p["value"] for p in env.metric(job["id"], "train.lr")]
    assert lrs and LEARNING_RATE < max(lrs) <= LEARNING_RATE * 2 + 1e-12
    # Each node's launcher log shows its share of the rendezvous.
    for rank, node in placed.items():
        agent_log = env.log(job["id"], stream=f"agent-{node}")
        assert f"node rank {rank} of 2, 1 process(es) per node" in agent_log, agent_log[-3000:]


def test_two_nodes_on_one_machine_match_one_node_with_two_processes(env: Env) -> None:
    env.agent("node-a", slots=1, wrap=_pin(0))
    env.agent("node-b", slots=1, wrap=_pin(1))
    env.agent("node-c", slots=2)
    env.ready("node-a", "node-b", "node-c")

    started = time.monotonic()
    multi = env.submit(nodes=2, ppn=1)
    single = env.submit(nodes=1, ppn=2)
    jobs = {job_id: env.wait(job_id) for job_id in (multi, single)}
    took = time.monotonic() - started

    # Best fit put the 2 × 1 job on the two 1-slot nodes and the 1 × 2 job on the 2-slot one.
    _check_two_node_run(env, jobs[multi], {"node-a", "node-b"})
    assert jobs[single]["status"] == "succeeded", jobs[single]
    assert jobs[single]["nodes"] == ["node-c"]

    # Same seed, same data, same world size: the same training, on 2 nodes or on 1
    # (every rank does its arithmetic on one thread in both jobs).
    for name in ("val.loss", "val.top1", "train.loss"):
        a, b = _series(env.metric(multi, name)), _series(env.metric(single, name))
        assert [p[:2] for p in a] == [p[:2] for p in b], (name, a, b)
        assert {p[0] for p in a} == {1, 2}, (name, a)
        assert [p[2] for p in a] == pytest.approx([p[2] for p in b], rel=1e-5, abs=1e-7), (name, a, b)
    print(
        f"\n2x1 and 1x2 jobs (concurrently) took {took:.1f} s; val.loss {_by_epoch(env.metric(multi, 'val.loss'))}"
    )


@pytest.fixture
def netns_hosts() -> Iterator[NetnsCluster]:
    require_netns()
    with NetnsCluster(2) as cluster:
        yield cluster


def test_two_nodes_on_separate_network_hosts(
    netns_hosts: NetnsCluster, make_settings: Any, tmp_path: Path
) -> None:
    # The API listens only on the gateway address: loopback is useless to the hosts.
    settings = _cluster_settings(make_settings, master_port_min=22500, master_port_max=22999)
    with open_env(settings, tmp_path, host=netns_hosts.gateway) as env:
        names = []
        for i, host in enumerate(netns_hosts.hosts):
            name = f"{host.name}-node"
            names.append(name)
            # No --address: each agent finds the address facing the API, on its own eth0.
            env.agent(name, slots=1, wrap=[*host.argv([]), *_pin(i)], env={"NO_PROXY": "*"})
        env.ready(*names)
        nodes = {n["name"]: n for n in env.user.get("/v1/cluster").json()["nodes"]}
        assert {nodes[n]["address"] for n in names} == {h.address for h in netns_hosts.hosts}

        started = time.monotonic()
        job_id = env.submit(nodes=2, ppn=1, epochs=1)
        job = env.wait(job_id)
        took = time.monotonic() - started
        _check_two_node_run(env, job, set(names))
        rank0_node = _placements(job)[0]
        assert job["attempts"][-1]["master_addr"] == nodes[rank0_node]["address"]
        print(f"\n2x1 job across network namespaces took {took:.1f} s")


def _run_dir(agent: AgentProcess, job_id: str) -> Path:
    runs = list((agent.work_dir / "runs").glob(f"{job_id}-*"))
    assert len(runs) == 1, runs
    return runs[0]


def _running(job: dict[str, Any]) -> bool:
    return job["status"] == "running" and ((job["progress"] or {}).get("step") or 0) >= 1


def _node_dirs(env: Env, job: dict[str, Any]) -> dict[str, Path]:
    """node name → the job's run directory on that node."""
    agents = {a.name: a for a in env.agents}
    return {node: _run_dir(agents[node], job["id"]) for node in _placements(job).values()}


def test_a_failing_rank_on_one_node_stops_every_node(env: Env) -> None:
    # Global rank 1 (on node rank 1) raises at its third step; rank 0 is then stuck in a collective.
    fault = {"TORCHYARD_TEST_FAIL_RANK": "1", "TORCHYARD_TEST_FAIL_STEP": "3"}
    env.agent("node-a", slots=1, wrap=_pin(0), env=fault)
    env.agent("node-b", slots=1, wrap=_pin(1), env=fault)
    env.ready("node-a", "node-b")
    job_id = env.submit(nodes=2, ppn=1, epochs=20)
    job = env.wait(job_id, lambda j: j["status"] in ("running", "failed"))
    placed = _placements(job)
    dirs = _node_dirs(env, job)
    job = env.wait(job_id, timeout=120)
    failed_at = time.time()
    assert job["status"] == "failed", job
    failure = job["failure"]
    # The root cause, not its echo on the other node (a broken gloo collective).
    assert failure["code"] == "RankFailedError", failure
    assert (failure["rank"], failure["node"]) == (1, placed[1]), failure
    assert "injected failure" in failure["message"]
    assert "Traceback" in failure["traceback"] and "injected failure" in failure["traceback"]
    # Nothing of the job runs on either node, seconds after the rank raised.
    raised_at = json.loads((dirs[placed[1]] / "failure-rank-1.json").read_text())["time"]
    for node, directory in dirs.items():
        assert wait_until_gone(str(directory), timeout=30) == [], node
    all_gone = time.time() - raised_at
    assert all_gone < 30, all_gone
    print(
        f"\nrank 1 raised on {placed[1]}: job failed {failed_at - raised_at:.1f} s later, "
        f"every rank of both nodes gone within {all_gone:.1f} s"
    )


def test_a_node_killed_mid_job_stops_every_node(make_settings: Any, tmp_path: Path) -> None:
    settings = _cluster_settings(make_settings, lease_timeout_s=SHORT_LEASE_TIMEOUT_S)
    with open_env(settings, tmp_path) as env:
        env.agent("node-a", slots=1, wrap=_pin(0))
        env.agent("node-b", slots=1, wrap=_pin(1))
        env.ready("node-a", "node-b")

        # A node dies mid-job: its agent and every process of its run, at once, without a word.
        job = env.wait(env.submit(nodes=2, ppn=1, epochs=20), _running)
        placed = _placements(job)
        # The node of node rank 0: it also held the rendezvous store the other node talks to.
        victim, survivor = placed[0], placed[1]
        dirs = _node_dirs(env, job)
        agents = {a.name: a for a in env.agents}
        doomed = [pid for pid, _ in processes_mentioning(str(dirs[victim]))]
        assert doomed
        agents[victim].process.send_signal(signal.SIGKILL)
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        agents[victim].process.wait(10)

        # The surviving node's ranks are gone within seconds; the job names the lost node.
        left = wait_until_gone(str(dirs[survivor]), timeout=30)
        survivor_stopped = time.monotonic() - killed
        assert left == [], left
        job = env.wait(job["id"], timeout=30)
        failed_after = time.monotonic() - killed
        assert job["status"] == "failed", job
        failure = job["failure"]
        assert (failure["code"], failure["node"]) == ("WorkerLostError", victim), failure
        assert victim in failure["message"]
        assert failed_after < 30
        assert agents[survivor].alive()
        print(
            f"node {victim} killed: ranks on {survivor} gone after {survivor_stopped:.1f} s, "
            f"job failed after {failed_after:.1f} s ({failure['message']})"
        )
