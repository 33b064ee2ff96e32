"""Hangs and preemption end to end with real processes: uvicorn, ``torchyard worker``
agents, torchrun and the trainer (2 ranks on CPU, gloo).

* A rank stopped with SIGSTOP hangs its peer in the next collective: the agent's hang
  watchdog dumps every rank's Python stacks into its log and ends the attempt with
  ``HangError`` naming the stuck ranks.
* SIGTERM to an agent drains its node; the ranks checkpoint at the next step boundary,
  node rank 0 uploads the checkpoint, the job goes back to ``queued`` (``preempted``,
  no restart counted), resumes on another agent from that checkpoint, and ends with the
  same per-epoch validation metrics as the same job run without interruption.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_e2e_training import Env, db_url, env, run_dir, settings  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

# SqueezeNet: small and quick on a CPU, and its dropout draws from every rank's generator.
MODEL = {"architecture": "squeezenet1_1"}


def _rank_pid(directory: Path, rank: int, timeout: float = 120) -> int:
    path = directory / f"progress-rank-{rank}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip().isdecimal():
            return int(path.read_text())
        time.sleep(0.2)
    raise AssertionError(f"no {path.name}")


def _rank_log(directory: Path, local_rank: int) -> str:
    return "".join(
        p.read_text(errors="replace")
        for p in sorted(directory.glob(f"torchrun-logs/**/attempt_*/{local_rank}/std*.log"))
    )


def _stepping(job: dict[str, Any], step: int = 1) -> bool:
    return job["status"] == "running" and (job.get("progress") or {}).get("step", 0) >= step


def test_hang_watchdog_dumps_stacks_and_fails_with_hang_error(env: Env) -> None:  # noqa: F811
    agent = env.agent("cpu-1", slots=2, grace_period=5)
    job_id = env.submit(
        model=MODEL,
        parameters={"epochs": 50},
        resources={"node_count": 1, "process_count_per_node": 2, "hang_timeout_s": 10, "max_restarts": 0},
    )
    env.wait(job_id, _stepping, timeout=240)
    directory = run_dir(agent, job_id)
    pid = _rank_pid(directory, 1)
    os.kill(pid, signal.SIGSTOP)  # rank 1 stops; rank 0 blocks in the next collective
    stopped_at = time.monotonic()
    job = env.wait(job_id, timeout=120)
    assert job["status"] == "failed", job
    failure = job["failure"]
    assert failure["code"] == "HangError" and failure["node"] == "cpu-1", failure
    assert "ranks 0, 1 stuck" in failure["message"] and "10 s" in failure["message"]
    assert "rank 1: last progress" in failure["message"] and "stopped by a signal" in failure["message"]
    assert time.monotonic() - stopped_at >= 10
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


def test_sigterm_preempts_and_the_job_resumes_elsewhere_exactly(env: Env) -> None:  # noqa: F811
    first = env.agent("cpu-1", slots=2, grace_period=5, env={"TORCHYARD_PREEMPT_GRACE_S": "60"})
    job = {"model": MODEL, "parameters": {"epochs": 3, "print_frequency": 1}}
    job_id = env.submit(**job)
    steps_per_epoch = 240 // (2 * 16)
    env.wait(job_id, lambda j: _stepping(j, steps_per_epoch + 2), timeout=300)
    assert run_dir(first, job_id).is_dir()
    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(120) == 0, first.log_text()[-4000:]
    log = first.log_text()
    assert "SIGTERM: draining node cpu-1" in log and "every placement preempted" in log

    preempted = env.user.get(f"/v1/jobs/{job_id}").json()
    assert preempted["status"] in ("queued", "scheduled", "running"), preempted
    assert preempted["restarts"] == 0
    attempt = preempted["attempts"][0]
    assert attempt["status"] == "preempted" and attempt["end_reason"]["code"] == "preempted"
    directory = run_dir(first, job_id)
    assert (directory / "preempted.json").is_file()
    agent_log = (directory / "agent.log").read_text()
    assert "uploaded" in agent_log and "checkpoint of epoch" in agent_log

    # Another node takes the job and resumes from the uploaded mid-epoch checkpoint.
    second = env.agent("cpu-2", slots=2)
    done = env.wait(job_id, timeout=400)
    assert done["status"] == "succeeded", done
    assert done["restarts"] == 0 and [a["status"] for a in done["attempts"]] == ["preempted", "succeeded"]
    resumed = (run_dir(second, job_id) / "agent.log").read_text()
    assert "resuming from it" in resumed
    assert "resuming epoch" in _rank_log(run_dir(second, job_id), 0)

    # The same job without interruption, on the second node: the same validation metrics.
    reference_id = env.submit(**job)
    reference = env.wait(reference_id, timeout=400)
    assert reference["status"] == "succeeded", reference
    got, want = _val_history(env.user, job_id), _val_history(env.user, reference_id)
    assert sorted(got) == sorted(want) and len(want) == 6
    for key, value in want.items():
        if key[0] == "val.top1":
            assert got[key] == value, key
        else:
            assert abs(got[key] - value) <= 1e-6, key
