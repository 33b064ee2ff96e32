"""Sweeps for real (docs/sweeps.md): a ``torchyard serve`` process (SIGKILLed and restarted mid-sweep)
and one real agent serve the whole module. Most trials are script jobs that train a
logistic regression with torch on the digits (16 px, 120 training and 30 validation images,
uploaded as datasets) at the learning rate the sweep gives it as ``$LR``, and report
``val.top1`` each epoch: a few seconds per trial. One sweep runs the built-in trainer
(two trials of the smallest torchvision model at 16 px for two epochs), whose per-epoch
metrics reach the sweep the same way, through the metrics table, and registers its best
trial's model.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.api_process import ApiProcess
from tests.support.factories import auth
from tests.support.worker_fixtures import (
    AgentProcess,
    processes_mentioning,
    start_agent,
    upload_digits,
    user_client,
    wait_for_node,
    wait_until_gone,
    worker_token,
)
from torchyard.client import Client

pytestmark = pytest.mark.slow

SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
    "TORCHYARD_LEASE_TIMEOUT_S": "10",
    "TORCHYARD_REAPER_INTERVAL_S": "0.3",
    "TORCHYARD_MASTER_PORT_MIN": "33600",
    "TORCHYARD_MASTER_PORT_MAX": "33699",
}


@dataclass
class SweepEnv:
    api: ApiProcess
    user: httpx.Client
    user_token: str
    train: str
    val: str
    agent: AgentProcess
    code: str | None = None

    def sweep(self, **over: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": "digits-sweep",
            "job": _script_job(self, epochs=2),
            "search_space": {"command_args.LR": {"type": "float", "low": 0.001, "high": 1.0, "log": True}},
            "objective": {"metric": "val.top1", "goal": "maximize"},
            "algorithm": "random",
            "max_trials": 4,
            "max_concurrent_trials": 2,
            "seed": 3,
        }
        body.update(over)
        r = self.user.post("/v1/sweeps", json=body)
        assert r.status_code == 201, r.text
        sweep: dict[str, Any] = r.json()
        return sweep

    def get(self, sweep_id: str) -> dict[str, Any]:
        r = self.user.get(f"/v1/sweeps/{sweep_id}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def wait(self, sweep_id: str, predicate: Any, timeout: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                sweep = self.get(sweep_id)
                if predicate(sweep):
                    return sweep
            except httpx.TransportError:
                sweep = {}
            assert time.monotonic() < deadline, (
                f"sweep not there in {timeout} s: {sweep}\napi log:\n{self.api.log()[-3000:]}\n"
                f"agent log:\n{self.agent.log_path.read_text(errors='replace')[-3000:]}"
            )
            time.sleep(0.3)


@pytest.fixture(scope="module")
def senv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SweepEnv]:
    tmp = tmp_path_factory.mktemp("sweeps")
    data = tmp / "data"
    data.mkdir()
    api = ApiProcess(data, f"sqlite:///{tmp}/torchyard.db", settings=SETTINGS).start().wait_ready()
    admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60)
    user = user_client(admin, api.url)
    token = worker_token(admin)
    train, val = upload_digits(user, tmp / "digits", per_class=12, size=16)
    agent = start_agent(api.url, token, "sweeper", tmp / "agent", slots=2, grace_period=2.0)
    wait_for_node(user, "sweeper")
    user_token = str(user.headers["Authorization"]).removeprefix("Bearer ")
    env = SweepEnv(api, user, user_token, train, val, agent)
    try:
        yield env
    finally:
        agent.discard()
        user.close()
        admin.close()
        api.kill()


def test_random_sweep_survives_an_api_sigkill_and_names_the_best_trial(senv: SweepEnv) -> None:
    sweep = senv.sweep()
    # Mid-sweep: the first trials train while the API is killed and started again.
    senv.wait(sweep["id"], lambda s: any(t["job_status"] == "running" for t in s["trials"]))
    # The agent is paused while the API is down (its trials' processes go on): a trial
    # ending during the outage would otherwise meet the agent's own bounded upload retries.
    os.kill(senv.agent.process.pid, signal.SIGSTOP)
    try:
        senv.api.kill()
        senv.api.start().wait_ready()
    finally:
        os.kill(senv.agent.process.pid, signal.SIGCONT)
    done = senv.wait(sweep["id"], lambda s: s["status"] != "running")
    assert done["status"] == "succeeded", done
    numbers = [t["number"] for t in done["trials"]]
    assert numbers == [0, 1, 2, 3]
    assert all(t["state"] == "completed" and t["epochs"] == 2 for t in done["trials"])
    # Each trial number has one job, and each job is an ordinary job of the sweep.
    jobs = [senv.user.get(f"/v1/jobs/{t['job_id']}").json() for t in done["trials"]]
    assert sorted(j["trial_number"] for j in jobs) == numbers
    assert {j["sweep_id"] for j in jobs} == {sweep["id"]} and {j["status"] for j in jobs} == {"succeeded"}
    for trial, job in zip(done["trials"], jobs, strict=True):
        lr = trial["params"]["command_args.LR"]
        assert 0.001 <= lr <= 1.0 and job["command"] == ["python", "logistic.py", str(lr), "2"]
        points = senv.user.get(f"/v1/jobs/{job['id']}/metrics", params={"name": "val.top1"}).json()["items"]
        # A trial's value is its best epoch.
        assert trial["value"] == max(p["value"] for p in points)
    best = done["best_trial"]
    assert best["value"] == max(t["value"] for t in done["trials"])
    # The Python client and the CLI read the same.
    with Client(senv.api.url, senv.user_token) as client:
        assert client.get_sweep(sweep["id"][:10]).best_trial.number == best["number"]  # type: ignore[union-attr]
    cli = [sys.executable, "-m", "torchyard.cli", "sweep"]
    conn = ["--url", senv.api.url, "--token", senv.user_token]
    shown = subprocess.run([*cli, "show", "digits-sweep", *conn], capture_output=True, text=True, check=True)
    assert f"best      trial {best['number']}: " in shown.stdout and "4 completed" in shown.stdout
    table = subprocess.run(
        [*cli, "trials", sweep["id"], "--sort", "value", *conn], capture_output=True, text=True, check=True
    )
    rows = table.stdout.splitlines()
    assert rows[0].split()[:4] == ["#", "STATE", "VALUE", "EPOCHS"] and len(rows) == 5
    assert rows[1].split()[0] == str(best["number"])


# A logistic regression on the digits' pixels, full-batch SGD at the learning rate given;
# ``val.top1`` each epoch (a fixed seed: the same start for every trial). 0.5 reaches about
# 0.9 after the first epoch; 1e-9 stays at 0.1.
LOGISTIC = """
import os, sys, time
from pathlib import Path

import torch
from PIL import Image
from torchyard.run import log_metric

lr, epochs = float(sys.argv[1]), int(sys.argv[2])


def load(root):
    dirs = sorted(p for p in Path(root).iterdir() if p.is_dir())
    if len(dirs) == 1 and any(p.is_dir() for p in dirs[0].iterdir()):
        dirs = sorted(p for p in dirs[0].iterdir() if p.is_dir())
    xs, ys = [], []
    for label, folder in enumerate(dirs):
        for f in sorted(folder.iterdir()):
            pixels = Image.open(f).convert("L").resize((16, 16)).tobytes()
            xs.append(torch.tensor(list(pixels), dtype=torch.float32) / 255.0)
            ys.append(label)
    return torch.stack(xs), torch.tensor(ys)


x, y = load(os.environ["TORCHYARD_INPUT_TRAIN"])
xv, yv = load(os.environ["TORCHYARD_INPUT_VAL"])
torch.manual_seed(1)
model = torch.nn.Linear(x.shape[1], 10)
opt = torch.optim.SGD(model.parameters(), lr=lr)
for epoch in range(1, epochs + 1):
    for _ in range(10):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        top1 = (model(xv).argmax(1) == yv).float().mean().item()
    log_metric("val.top1", top1, epoch=epoch)
    print(f"epoch {epoch}: val.top1 {top1:.4f}", flush=True)
    time.sleep(1.0)
"""


def _script_job(senv: SweepEnv, epochs: int) -> dict[str, Any]:
    if senv.code is None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            data = LOGISTIC.encode()
            info = tarfile.TarInfo("logistic.py")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        files = {"file": ("logistic.tar.gz", buf.getvalue(), "application/gzip")}
        r = senv.user.post("/v1/code", files=files)
        assert r.status_code == 201, r.text
        senv.code = r.json()["id"]
    return {
        "type": "script",
        "code": senv.code,
        "command": ["python", "logistic.py", "$LR", str(epochs)],
        "inputs": {"train": senv.train, "val": senv.val},
        "resources": {"node_count": 1, "process_count_per_node": 1},
    }


def test_asha_prunes_the_trial_with_a_learning_rate_that_learns_nothing(senv: SweepEnv) -> None:
    # The grid's seed puts the useful rate first (about 0.9 from epoch 1); 1e-9 stays at 0.1.
    sweep = senv.sweep(
        name="digits-asha",
        job=_script_job(senv, epochs=4),
        search_space={"command_args.LR": {"type": "categorical", "choices": [0.5, 1e-9]}},
        algorithm="grid",
        early_stopping={"type": "asha", "min_epochs": 1, "reduction_factor": 2},
        max_trials=2,
        max_concurrent_trials=1,
        seed=1,
    )
    done = senv.wait(sweep["id"], lambda s: s["status"] != "running")
    first, second = done["trials"]
    assert first["params"] == {"command_args.LR": 0.5} and first["state"] == "completed", done
    assert first["epochs"] == 4 and first["value"] > 0.5
    assert second["state"] == "pruned", done
    assert second["reason"] == "pruned by ASHA at epoch 1: val.top1 0.1 below the rung's top half"
    pruned = senv.user.get(f"/v1/jobs/{second['job_id']}").json()
    assert pruned["status"] == "cancelled" and pruned["cancel_reason"] == second["reason"]
    assert pruned["command"] == ["python", "logistic.py", "1e-09", "4"]
    # Less compute than running the grid out: the pruned trial stopped early.
    assert done["epochs_run"] < 8
    assert done["best_trial"]["number"] == 0


def test_cancel_stops_every_trial_and_leaves_no_process(senv: SweepEnv) -> None:
    sweep = senv.sweep(
        name="digits-cancel",
        job=_script_job(senv, epochs=200),
        search_space={"command_args.LR": {"type": "float", "low": 0.01, "high": 1.0, "log": True}},
        max_trials=4,
        max_concurrent_trials=2,
    )
    running = senv.wait(sweep["id"], lambda s: sum(t["epochs"] > 0 for t in s["trials"]) == 2)
    job_ids = [t["job_id"] for t in running["trials"]]
    assert all(processes_mentioning(j) for j in job_ids)
    r = senv.user.post(f"/v1/sweeps/{sweep['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    senv.wait(sweep["id"], lambda s: {t["job_status"] for t in s["trials"]} == {"cancelled"}, timeout=60)
    for job_id in job_ids:
        assert wait_until_gone(job_id) == []
    time.sleep(1.0)  # a few reaper passes: a cancelled sweep asks for no trial
    after = senv.get(sweep["id"])
    assert len(after["trials"]) == 2 and {t["state"] for t in after["trials"]} == {"cancelled"}


def test_train_trials_are_judged_by_the_trainers_epochs_and_the_best_registers_as_a_model(
    senv: SweepEnv,
) -> None:
    """Trials of the built-in trainer: the objective is the best of the points the trainer
    reports each epoch (``val.loss``, minimized: it moves every epoch even where two epochs of
    this tiny run leave ``val.top1`` at chance), and the best trial's job registers as any
    job's model."""
    job = {
        "type": "train",
        "model": {"architecture": "shufflenet_v2_x0_5"},  # 0.35 M parameters
        "train_dataset": senv.train,
        "validation_dataset": senv.val,
        "parameters": {
            "epochs": 2,
            "patience": 2,
            "image_size": 16,
            "batch_size": 16,
            "augmentation": "none",
        },
        "resources": {"node_count": 1, "process_count_per_node": 1},
    }
    sweep = senv.sweep(
        name="digits-train",
        job=job,
        search_space={"parameters.learning_rate": {"type": "categorical", "choices": [0.05, 0.0001]}},
        objective={"metric": "val.loss", "goal": "minimize"},
        algorithm="grid",
        max_trials=2,
        max_concurrent_trials=2,
    )
    done = senv.wait(sweep["id"], lambda s: s["status"] != "running", timeout=300)
    assert done["status"] == "succeeded", done
    for trial in done["trials"]:
        assert trial["state"] == "completed" and trial["epochs"] == 2, trial
        points = senv.user.get(f"/v1/jobs/{trial['job_id']}/metrics", params={"name": "val.loss"}).json()
        by_epoch = {p["epoch"]: p["value"] for p in points["items"]}
        assert sorted(by_epoch) == [1, 2]
        assert trial["intermediate"] == {str(e): v for e, v in by_epoch.items()}
        assert trial["value"] == min(by_epoch.values())
        trained = senv.user.get(f"/v1/jobs/{trial['job_id']}").json()
        lr = trial["params"]["parameters.learning_rate"]
        assert trained["parameters"]["learning_rate"] == lr and trained["type"] == "train"
    best = done["best_trial"]
    assert best["value"] == min(t["value"] for t in done["trials"])
    # The best trial's model is registered as any job's and comes back from the registry.
    r = senv.user.post("/v1/models", json={"name": "digits-best", "job_id": best["job_id"]})
    assert r.status_code == 201, r.text
    version = r.json()
    assert version["job_id"] == best["job_id"] and version["architecture"] == "shufflenet_v2_x0_5"
    assert version["classes"] == [str(i) for i in range(10)]
    got = senv.user.get(f"/v1/models/digits-best/versions/{version['version']}")
    assert got.status_code == 200, got.text
    assert got.json()["job_id"] == best["job_id"] and got.json()["sha256"] == version["sha256"]
