"""Hangs and preemption end to end with real processes: uvicorn, ``torchyard worker``
agents, torchrun and the trainer (2 ranks on CPU, gloo).

* A rank stopped with SIGSTOP hangs its peer in the next collective: the agent's hang
  watchdog dumps every rank's Python stacks into its log and ends the attempt with
  ``HangError`` naming the stuck ranks.
* SIGTERM to an agent drains its node; the ranks checkpoint at the next step boundary,
  node rank 0 uploads the checkpoint, the job goes back to ``queued`` (``preempted``,
  no restart counted) and resumes on another agent from that checkpoint; there a rank
  is SIGKILLed (``RankKilledError``, retried) and the job resumes once more. It ends
  with the same per-epoch validation metrics as the same job run without interruption.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Env, run_dir
from tests.support.worker_fixtures import AgentProcess, agent_log_of, start_agent, wait_for_node
from worker.agent.watchdog import host_pid
from worker.trainer.control import PREEMPT_REQUEST_FILE

pytestmark = pytest.mark.slow

# SqueezeNet: small and quick on a CPU, and its dropout draws from every rank's generator.
MODEL = {"architecture": "squeezenet1_1"}


def _rank_pid(directory: Path, rank: int, agent: AgentProcess, timeout: float = 120) -> int:
    """The rank's pid out here: its progress file holds the pid it sees, which in a sandbox's
    PID namespace is another process's number out here (see worker.agent.watchdog.host_pid)."""
    path = directory / f"progress-rank-{rank}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip().isdecimal():
            pid = host_pid(int(path.read_text()), agent.process.pid)
            if pid is not None:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no {path.name} of a live rank under the agent")


def _rank_log(directory: Path, local_rank: int) -> str:
    return "".join(
        p.read_text(errors="replace")
        for p in sorted(directory.glob(f"torchrun-logs/**/attempt_*/{local_rank}/std*.log"))
    )


def _agent(setup: Env, name: str, **kw: Any) -> AgentProcess:
    """An agent; registering may take a while on a busy machine (it loads torch first)."""
    agent = start_agent(setup.server.url, setup.token, name, setup.tmp / name, slots=2, **kw)
    setup.agents.append(agent)
    wait_for_node(setup.user, name, timeout=240)
    return agent


def _stepping(job: dict[str, Any], step: int = 1) -> bool:
    return job["status"] == "running" and ((job.get("progress") or {}).get("step") or 0) >= step


def test_hang_watchdog_dumps_stacks_and_fails_with_hang_error(env: Env) -> None:
    agent = _agent(env, "cpu-1", grace_period=5)
    job_id = env.submit(
        model=MODEL,
        # Long enough never to end before the rank is stopped: a small model stuck at chance
        # would otherwise stop early after ``patience`` epochs of a second or so each.
        parameters={"epochs": 1000, "patience": 1000},
        resources={"node_count": 1, "process_count_per_node": 2, "hang_timeout_s": 10, "max_restarts": 0},
    )
    env.wait(job_id, _stepping, timeout=240)
    directory = run_dir(agent, job_id)
    pid = _rank_pid(directory, 1, agent)
    os.kill(pid, signal.SIGSTOP)  # rank 1 stops; rank 0 blocks in the next collective
    job = env.wait(job_id, timeout=120)
    assert job["status"] == "failed", job
    failure = job["failure"]
    assert failure["code"] == "HangError" and failure["node"] == "cpu-1", failure
    assert "ranks 0, 1 stuck" in failure["message"] and "10 s" in failure["message"]
    assert "rank 1: last progress" in failure["message"] and "stopped by a signal" in failure["message"]
    # Every rank's Python stacks, all threads, are in its log; the stopped one's too.
    for local in (0, 1):
        text = _rank_log(directory, local)
        assert "most recent call first" in text and "train_epoch" in text, text[-3000:]


def _val_history(client: httpx.Client, job_id: str) -> dict[tuple[str, int], float]:
    values: dict[tuple[str, int], float] = {}
    after = 0
    while True:
        page = client.get(f"/v1/jobs/{job_id}/metrics", params={"after": after, "limit": 500}).json()
        if not page["items"]:
            return values
        for item in page["items"]:
            if item["name"] in ("val.loss", "val.top1"):
                key = (item["name"], item["epoch"])
                assert key not in values, f"{key} shown twice"
                values[key] = item["value"]
        after = page["next_after"]


def _wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in {path}")


def _wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.1)


def _release(marker: Path) -> None:
    """Let a rank 0 paused by ``TORCHYARD_TEST_PAUSE_AT`` go on, once it got there."""
    _wait_for_file(marker, timeout=400)
    marker.unlink()


def test_preempted_then_killed_job_resumes_exactly(env: Env) -> None:
    """SIGTERM to the agent preempts the job mid-epoch; it resumes on another node from
    the uploaded checkpoint; there a rank is SIGKILLed (RankKilledError, restart 1), and
    the job resumes again from the latest uploaded epoch checkpoint. It ends with the
    validation metrics of the same job run without interruption."""
    # Rank 0 waits half-way through epoch 2 until the preemption is requested, so the
    # request lands mid-epoch however slow the machine is.
    first = _agent(
        env,
        "cpu-1",
        grace_period=5,
        env={"TORCHYARD_PREEMPT_GRACE_S": "60", "TORCHYARD_TEST_PAUSE_AT": "train:2"},
    )
    job = {"model": MODEL, "parameters": {"epochs": 3, "print_frequency": 1}}
    job_id = env.submit(**job)
    env.wait(job_id, lambda j: j["status"] == "running", timeout=300)
    directory = run_dir(first, job_id)
    paused = directory / "paused-train-2"
    _wait_for_file(paused, timeout=300)
    first.process.send_signal(signal.SIGTERM)
    _wait_for_file(directory / PREEMPT_REQUEST_FILE, timeout=60)
    paused.unlink()
    assert first.process.wait(120) == 0, first.log_text()[-4000:]
    log = first.log_text()
    assert "SIGTERM: draining node cpu-1" in log and "every placement preempted" in log
    assert (directory / "preempted.json").is_file()
    assert "checkpoint of epoch 1 step" in agent_log_of(directory).read_text()
    preempted = env.user.get(f"/v1/jobs/{job_id}").json()
    assert preempted["restarts"] == 0, preempted
    assert preempted["attempts"][0]["status"] == "preempted", preempted

    # Another node resumes it from the mid-epoch checkpoint.
    # Another node resumes it from the mid-epoch checkpoint. Its rank 0 waits before the
    # validation of epoch 3 (epoch 2's checkpoint written), so the kill below lands in a
    # known place however fast the machine is.
    second = _agent(env, "cpu-2", env={"TORCHYARD_TEST_PAUSE_AT": "validation:3"})
    env.wait(job_id, lambda j: len(j["attempts"]) == 2 and j["status"] == "running", timeout=300)
    runs = sorted((second.work_dir / "runs").glob(f"{job_id}-a2-*"))
    assert len(runs) == 1
    _wait_for_file(runs[0] / "paused-validation-3", timeout=400)
    _wait_for_text(agent_log_of(runs[0]), "checkpoint of epoch 2 uploaded", timeout=120)
    assert "resuming from it" in (agent_log_of(runs[0])).read_text()
    # A rank is killed from outside: a retryable RankKilledError, restart 1.
    os.kill(_rank_pid(runs[0], 1, second), signal.SIGKILL)
    env.wait(job_id, lambda j: len(j["attempts"]) == 3 and j["status"] == "running", timeout=300)
    third = sorted((second.work_dir / "runs").glob(f"{job_id}-a3-*"))
    assert len(third) == 1
    _release(third[0] / "paused-validation-3")
    done = env.wait(job_id, timeout=600)
    assert done["status"] == "succeeded", done
    statuses = [a["status"] for a in done["attempts"]]
    assert done["restarts"] == 1 and statuses == ["preempted", "failed", "succeeded"], done
    assert done["attempts"][1]["end_reason"]["code"] == "RankKilledError", done
    assert "resuming after epoch 2" in _rank_log(third[0], 0)

    # The same job without interruption: the same validation metrics, each epoch once.
    reference_id = env.submit(**job)
    env.wait(reference_id, lambda j: j["status"] == "running", timeout=300)
    _release(run_dir(second, reference_id) / "paused-validation-3")
    reference = env.wait(reference_id, timeout=600)
    assert reference["status"] == "succeeded", reference
    got, want = _val_history(env.user, job_id), _val_history(env.user, reference_id)
    assert sorted(got) == sorted(want) and len(want) == 6
    for key, value in want.items():
        if key[0] == "val.top1":
            assert got[key] == value, key
        else:
            assert abs(got[key] - value) <= 1e-6, key
