"""What the engines' end-to-end tests share: a real API process whose engine runs the jobs
(Slurm, Kubernetes), a user's client, the digits datasets, and the launchers' run folders."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api_process import ApiProcess
from tests.support.script_helpers import code_archive
from tests.support.worker_fixtures import agent_log_of, wait_for_job
from worker.trainer.hooks import HOOKS_VAR

# MobileNetV3-Small: the smallest torchvision network the trainer takes at 16 px (a 6 MB model).
MODEL = {"architecture": "mobilenet_v3_small"}
PARAMETERS = {
    "epochs": 2,
    "image_size": 16,
    "batch_size": 16,
    "learning_rate": 0.02,
    "print_frequency": 1,
    "random_seed": 3,
}
# The launcher script exports what this file holds (a test hook for the next engine jobs).
LAUNCH_ENV = "launch.env"
# ``probe.py SECONDS`` prints what it was given and sleeps; ``probe.py barrier`` then waits
# for every rank at a barrier on a TCPStore at MASTER_ADDR:MASTER_PORT (a script whose rank 0 could end before rank 1 started
# would end the job without rank 1: a success ends the attempt).
PROBE = """
import os, sys, time
keys = ("NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "NNODES", "NPROC_PER_NODE")
print(" ".join(f"{k}={os.environ.get(k)}" for k in keys), flush=True)
if sys.argv[1:] == ["barrier"]:
    from datetime import timedelta
    from torch.distributed import TCPStore
    rank = int(os.environ.get("RANK") or os.environ["NODE_RANK"])  # per process, or per node
    world = int(os.environ.get("WORLD_SIZE") or os.environ["NNODES"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                     timeout=timedelta(seconds=120), wait_for_workers=True)
    store.set(f"here-{rank}", "1")
    store.wait([f"here-{r}" for r in range(world)])
    store.set(f"left-{rank}", "1")
    if rank == 0:  # the store's host leaves last
        store.wait([f"left-{r}" for r in range(world)])
else:
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def write_launcher(root: Path) -> Path:
    """The command the engine starts on each node: torchyard's one-placement launcher, with
    what :meth:`EngineEnv.launch_env` left for it."""
    launcher = root / "launcher.sh"
    hook = root / LAUNCH_ENV
    launcher.write_text(
        f'#!/bin/sh\n[ -f {hook} ] && . {hook}\nexec {sys.executable} -m worker.agent.placement_launcher "$@"\n'
    )
    launcher.chmod(0o755)
    return launcher


@dataclass
class EngineEnv:
    api: ApiProcess
    user: httpx.Client
    digits: tuple[str, str]
    root: Path
    reference: dict[tuple[str, int], float] | None = None

    def submit(self, body: dict[str, Any]) -> str:
        r = self.user.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        return job_id

    def train(self, nodes: int = 1, **parameters: Any) -> str:
        train, val = self.digits
        return self.submit(
            {
                "name": "digits",
                "model": MODEL,
                "train_dataset": train,
                "validation_dataset": val,
                "parameters": {**PARAMETERS, **parameters},
                "resources": {"node_count": nodes, "process_count_per_node": 1},
            }
        )

    def script(self, command: list[str], nodes: int = 1, launch: str = "per_process", **extra: Any) -> str:
        r = self.user.post(
            "/v1/code",
            data={"name": "probe"},
            files={"file": ("src.tar.gz", code_archive({"probe.py": PROBE}), "application/gzip")},
        )
        assert r.status_code == 201, r.text
        return self.submit(
            {
                "type": "script",
                "code": r.json()["id"],
                "command": command,
                "distribution": {"launch": launch},
                "resources": {"node_count": nodes, "process_count_per_node": 1, "max_restarts": 0},
                **extra,
            }
        )

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.user.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def wait(
        self, job_id: str, predicate: Callable[[dict[str, Any]], bool] | None = None, timeout: float = 90
    ) -> dict[str, Any]:
        try:
            if predicate is None:
                return wait_for_job(self.user, job_id, timeout=timeout)
            return wait_for_job(self.user, job_id, predicate, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- api log\n{self.api.log()[-5000:]}\n{self.outputs()}") from None

    def outputs(self) -> str:
        """What the engine kept of its jobs' output, for a failure's message."""
        return ""

    def history(self, job_id: str) -> dict[tuple[str, int], float]:
        """``{(metric, epoch or step): value}``: the validation metrics by epoch and the
        training loss by step (a resume that is not exact changes the losses after it)."""
        history = {}
        for name, key in (("val.top1", "epoch"), ("val.loss", "epoch"), ("train.loss", "step")):
            r = self.user.get(f"/v1/jobs/{job_id}/metrics", params={"name": name, "limit": 1000})
            assert r.status_code == 200, r.text
            history.update({(name, p[key]): p["value"] for p in r.json()["items"]})
        return history

    @contextlib.contextmanager
    def launch_env(self, **variables: str) -> Iterator[None]:
        """The launchers of the engine's jobs started meanwhile get these variables (and the
        test suite's trainer hooks, which the API's environment, and so the jobs', lacks)."""
        hook = self.root / LAUNCH_ENV
        variables = {HOOKS_VAR: os.environ[HOOKS_VAR], **variables}
        hook.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in variables.items()))
        try:
            yield
        finally:
            hook.unlink()

    def assert_preempted_then_resumed_exactly(
        self, job_id: str, first_run: Path, reference: dict[tuple[str, int], float], timeout: float
    ) -> dict[str, Any]:
        """The job's first attempt was preempted after a checkpoint, its second succeeded, no
        restart counted, and its metrics are the uninterrupted run's (``reference``)."""
        job = self.wait(job_id, timeout=timeout)
        assert job["status"] == "succeeded" and job["restarts"] == 0, job
        first, second = job["attempts"]
        assert first["status"] == "preempted" and second["status"] == "succeeded", job["attempts"]
        assert first["engine_job_id"] != second["engine_job_id"]
        assert re.search(r"checkpoint of epoch \d step \d+ uploaded", agent_log_of(first_run).read_text())
        got = self.history(job_id)
        assert sorted(got) == sorted(reference)
        for key, value in reference.items():
            assert got[key] == (value if key[0] == "val.top1" else pytest.approx(value, abs=1e-6)), key
        return job

    def run_dir(self, job_id: str, attempt: int, node: str) -> Path:
        return self.root / "nodes" / "runs" / f"{job_id}-a{attempt}-{node}"

    def wait_file(self, job_id: str, attempt: int, name: str, timeout: float = 90) -> Path:
        """The first of an attempt's run directories (any node) where ``name`` appears."""
        deadline = time.monotonic() + timeout
        while True:
            found = sorted((self.root / "nodes" / "runs").glob(f"{job_id}-a{attempt}-*/{name}"))
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {name} in attempt {attempt}'s run\n{self.api.log()[-3000:]}\n{self.outputs()}"
                )
            time.sleep(0.1)
