"""A node of a 2-node job dies for real, on separate network hosts, and the job restarts on
two nodes and resumes from its checkpoint (docs/restarts.md).

Three hosts, each a network namespace with its own address and one agent of one slot; the
API listens only on the gateway address. A 2-node × 1-process job runs on two of them; once
an epoch's checkpoint is stored, every process of the host of node rank 0 (its agent,
torchrun and the rank, which also holds the rendezvous store) is SIGKILLed at once. The
survivor's rank is stopped, the job goes back to the queue after the lease timeout, is
placed on the survivor and the third host, downloads the checkpoint and resumes: the
epochs before the kill are not trained (nor reported) again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_cluster_training import _cluster_settings, _placements, _run_dir, open_env
from tests.support.netns import NetnsCluster, _kill_netns_processes, require_netns
from tests.support.worker_fixtures import checkpoint_epoch, processes_mentioning, wait_until_gone

pytestmark = pytest.mark.slow

EPOCHS = 3
PARAMETERS = {"epochs": EPOCHS, "image_size": 16, "batch_size": 16, "print_frequency": 2}


@pytest.fixture
def hosts() -> Iterator[NetnsCluster]:
    require_netns()
    with NetnsCluster(3) as cluster:
        yield cluster


def test_a_killed_node_of_a_two_node_job_restarts_on_two_nodes_and_resumes(
    hosts: NetnsCluster, make_settings: Any, tmp_path: Path
) -> None:
    settings = _cluster_settings(
        make_settings, lease_timeout_s=6.0, master_port_min=25000, master_port_max=25499
    )
    with open_env(settings, tmp_path, host=hosts.gateway) as env:
        by_name = {}
        for host in hosts.hosts:
            name = f"{host.name}-node"
            by_name[name] = host
            env.agent(name, slots=1, wrap=host.argv([]), env={"NO_PROXY": "*"})
        env.ready(*by_name, timeout=300)  # three agents importing torch at once on a busy machine

        job_id = env.submit(nodes=2, ppn=1, max_restarts=2, **PARAMETERS)
        job = env.wait(job_id, lambda j: j["status"] in ("running", "failed", "succeeded"))
        assert job["status"] == "running", job
        placed = _placements(job)
        victim, survivor = placed[0], placed[1]
        survivor_dir = _run_dir(next(a for a in env.agents if a.name == survivor), job_id)
        # Wait for epoch 1's checkpoint, then the whole host dies at once.
        env.wait(
            job_id,
            lambda j: j["status"] != "running" or checkpoint_epoch(settings.sqlalchemy_url, job_id) >= 1,
        )
        agent = next(a for a in env.agents if a.name == victim)
        _kill_netns_processes(by_name[victim].netns)
        agent.process.wait(10)
        assert processes_mentioning(str(_run_dir(agent, job_id))) == []

        # The survivor's rank stops; the job restarts on the survivor and the third host.
        assert wait_until_gone(str(survivor_dir), timeout=60) == []
        job = env.wait(job_id, timeout=300)
        assert job["status"] == "succeeded", job
        assert job["restarts"] == 1
        first, second = job["attempts"]
        assert first["number"] == 1 and second["number"] == 2
        assert sorted(first["nodes"]) == sorted([victim, survivor])
        assert first["status"] == "failed"
        assert first["end_reason"]["code"] == "WorkerLostError", first
        assert victim in first["end_reason"]["message"]
        third = next(n for n in by_name if n not in (victim, survivor))
        assert sorted(second["nodes"]) == sorted([survivor, third])
        assert second["status"] == "succeeded"
        assert any(f"on node {victim} (restart 1 of 2)" in h["message"] for h in job["history"]), job

        # Attempt 2 resumed from the checkpoint: its rank 0 says so, and it never reported
        # the epochs the checkpoint already held.
        rank0 = env.log(job_id, rank=0)
        resumed = re.search(r"resuming after epoch (\d+)", rank0)
        assert resumed, rank0[-3000:]
        done = int(resumed.group(1))
        assert 1 <= done < EPOCHS
        r = env.user.get(
            f"/v1/jobs/{job_id}/metrics",
            params={"name": "val.top1", "include_superseded": "true", "limit": 10000},
        )
        assert r.status_code == 200, r.text
        by_attempt: dict[int, list[int]] = {}
        for p in r.json()["items"]:
            by_attempt.setdefault(p["attempt"], []).append(p["epoch"])
        assert sorted(by_attempt[2]) == list(range(done + 1, EPOCHS + 1)), by_attempt
        assert set(range(1, done + 1)) <= set(by_attempt[1]), by_attempt
        # The default history shows every epoch once.
        assert sorted(p["epoch"] for p in env.metric(job_id, "val.top1")) == list(range(1, EPOCHS + 1))
