"""Script jobs run by real agents (docs/script-jobs.md): both launch modes, the variables each process
sees, metrics, logs, outputs (whole and one file), a failing rank, and cancel."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from tests.conftest import fast_leases
from tests.support.script_helpers import PROBE, ScriptEnv, script_env, secrets_up_to_agent
from tests.support.worker_fixtures import processes_mentioning, upload_dataset, wait_until_gone
from torchyard.client import Client

SCRIPT_SETTINGS = fast_leases(lease_s=15.0, ports=(26000, 26499))


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    settings: Settings = make_settings(**SCRIPT_SETTINGS)
    return settings


@pytest.fixture
def env(settings: Settings, tmp_path: Path) -> Iterator[ScriptEnv]:
    with script_env(settings, tmp_path) as e:
        yield e


def _metrics(env: ScriptEnv, job_id: str, name: str) -> list[tuple[int, int, float]]:
    r = env.user.get(f"/v1/jobs/{job_id}/metrics", params={"name": name})
    assert r.status_code == 200, r.text
    return sorted((p["rank"], p["step"], p["value"]) for p in r.json()["items"])


def test_per_process_1x2_variables_metrics_logs_and_outputs(env: ScriptEnv, tmp_path: Path) -> None:
    from torchyard.sample_data import write_digits

    # Every process's system metrics, sampled by the agent (docs/operations.md).
    agent = env.agent("solo", slots=2, env={"TORCHYARD_SYS_METRICS_INTERVAL_S": "0.2"})
    train_dir, _ = write_digits(tmp_path / "digits", per_class=2, size=16)
    data = upload_dataset(env.user, train_dir, "tiny")
    code = env.upload_code({"probe.py": PROBE})
    job_id = env.submit(
        code,
        ["python", "probe.py", "--rank", "$RANK", "--of", "${WORLD_SIZE}", "$$HOME", "$UNKNOWN"],
        inputs={"data": data["id"]},
        environment={"variables": {"GREETING": "hola"}},
        resources={"node_count": 1, "process_count_per_node": 2},
    )
    job = env.wait(job_id)
    assert job["status"] == "succeeded", job
    seen = env.seen(job_id)
    assert sorted(seen) == [0, 1]
    cwds = set()
    for rank, s in seen.items():
        assert (s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert s["NODE_RANK"] == "0" and s["MASTER_ADDR"] and s["MASTER_PORT"].isdigit()
        assert s["NNODES"] is None and s["NPROC_PER_NODE"] is None
        assert s["argv"] == ["--rank", str(rank), "--of", "2", "$HOME", "$UNKNOWN"]
        assert s["GREETING"] == "hola" and s["token_visible"] is False
        # Nor in the environment the agent started with (/proc/<agent pid>/environ).
        assert secrets_up_to_agent(s, agent.process.pid) == []
        assert s["all_reduce"] == 3.0  # 1 + 2: the two processes met through the variables
        inputs = Path(s["TORCHYARD_INPUT_DATA"])
        assert inputs.is_relative_to(Path(s["TORCHYARD_OUTPUT_DIR"]).parent)  # in the run, not the cache
        cwds.add(s["cwd"])
    assert len(cwds) == 2  # a fresh copy of the code each
    # Each process has an MLflow token of its own (for the job's endpoint), not the worker's.
    assert len({s["mlflow_token"] for s in seen.values()}) == 2 and env.token not in {
        s["mlflow_token"] for s in seen.values()
    }
    assert _metrics(env, job_id, "probe.rank") == [(0, 0, 0.0), (1, 0, 1.0)]
    assert _metrics(env, job_id, "probe.auto") == [(0, 0, 1.5), (0, 1, 2.5), (1, 0, 1.5), (1, 1, 2.5)]
    for name in ("sys.cpu_percent", "sys.rss_bytes"):
        assert {rank for rank, _, _ in _metrics(env, job_id, name)} == {0, 1}, name
    assert "hello from rank 0" in env.log(job_id, rank=0)
    assert "hello from rank 1" in env.log(job_id, rank=1)
    # The text files under ./logs are log streams of their own; a binary one is left out.
    r = env.user.get(f"/v1/jobs/{job_id}/logs/streams")
    assert r.status_code == 200, r.text
    files = {s["name"]: s for s in r.json()["streams"] if s["name"].startswith("file-")}
    assert sorted(files) == ["file-0/rank-0.txt", "file-0/rank-1.txt", "file-0/sub/notes.log"]
    assert files["file-0/sub/notes.log"]["node"] == "solo"
    assert files["file-0/sub/notes.log"]["size"] == len("ünïcode notes".encode())
    assert env.log(job_id, stream="file-0/rank-1.txt") == "extra log of rank 1"
    assert env.log(job_id, stream="file-0/sub/notes.log") == "ünïcode notes"
    bad = env.user.get(f"/v1/jobs/{job_id}/logs", params={"stream": "file-0/../job.json"})
    assert bad.status_code == 422 and "file-<node rank>/<path>" in bad.json()["message"]
    one = env.user.get(f"/v1/jobs/{job_id}/outputs", params={"path": "rank-1.json"})
    assert one.status_code == 200 and one.json()["RANK"] == "1"
    missing = env.user.get(f"/v1/jobs/{job_id}/outputs", params={"path": "nope.txt"})
    assert missing.status_code == 404
    escape = env.user.get(f"/v1/jobs/{job_id}/outputs", params={"path": "../job.json"})
    assert escape.status_code == 422
    # The Python client (torchyard download --outputs) checks what it gets against the sha256.
    with Client(env.server.url, env.user.headers["Authorization"].split()[1]) as client:
        whole = client.download_outputs(job_id, tmp_path / "out.tar.gz")
        single = client.download_outputs(job_id, tmp_path / "rank-0.json", path="rank-0.json")
    assert hashlib.sha256(whole.read_bytes()).hexdigest() == job["outputs_sha256"]
    assert json.loads(single.read_text())["RANK"] == "0"
    # The same through the command line: torchyard download JOB --outputs [-o DIR or
    # NAME.tar.gz] [--path F]: unpacked into a new directory, or the archive as it is.
    cli_dir = tmp_path / "cli"
    cli_dir.mkdir()
    cli_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    cli_env.update(TORCHYARD_URL=env.server.url, TORCHYARD_TOKEN=env.user.headers["Authorization"].split()[1])
    for args, name in (
        (["--outputs"], f"outputs-{job_id}"),
        (["--outputs", "-o", "outputs.tar.gz"], "outputs.tar.gz"),
        (["--outputs", "--path", "rank-1.json"], "rank-1.json"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "torchyard.cli", "download", job_id, *args],
            env=cli_env, cwd=cli_dir, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == name
    got = (cli_dir / "outputs.tar.gz").read_bytes()
    assert hashlib.sha256(got).hexdigest() == job["outputs_sha256"]
    assert json.loads((cli_dir / "rank-1.json").read_text())["RANK"] == "1"
    assert json.loads((cli_dir / f"outputs-{job_id}" / "rank-1.json").read_text())["RANK"] == "1"
    missing_cli = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "download", job_id, "--outputs", "--path", "nope.txt"],
        env=cli_env, cwd=cli_dir, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert missing_cli.returncode != 0 and "Traceback" not in missing_cli.stderr
    assert not (cli_dir / "nope.txt").exists()  # nothing half-written


def test_per_node_1x2_runs_torchrun_once(env: ScriptEnv) -> None:
    agent = env.agent("solo", slots=2)
    code = env.upload_code({"probe.py": PROBE})
    job_id = env.submit(
        code,
        ["torchrun", "--nnodes", "$NNODES", "--nproc-per-node", "$NPROC_PER_NODE", "--node-rank",
         "$NODE_RANK", "--master-addr", "$MASTER_ADDR", "--master-port", "$MASTER_PORT", "probe.py"],
        distribution={"launch": "per_node"},
        resources={"node_count": 1, "process_count_per_node": 2},
    )  # fmt: skip
    job = env.wait(job_id)
    assert job["status"] == "succeeded", job
    seen = env.seen(job_id)
    assert sorted(seen) == [0, 1]
    for rank, s in seen.items():
        # The command saw the per-node variables; torchrun gave its ranks their own.
        assert (s["NNODES"], s["NPROC_PER_NODE"], s["NODE_RANK"]) == ("1", "2", "0")
        assert s["RANK"] == str(rank) and s["WORLD_SIZE"] == "2" and s["all_reduce"] == 3.0
        assert s["token_visible"] is False
        assert secrets_up_to_agent(s, agent.process.pid) == []  # torchrun's environment neither
    assert len({s["cwd"] for s in seen.values()}) == 1  # one copy of the code for the node
    assert _metrics(env, job_id, "probe.rank") == [(0, 0, 0.0), (1, 0, 1.0)]
    assert "hello from rank 1" in env.log(job_id, rank=0)  # the node's output is its first rank's stream


FAILING = """
import os, sys, time
rank = int(os.environ["RANK"])
out = os.environ["TORCHYARD_OUTPUT_DIR"]
open(os.path.join(out, f"partial-{rank}.txt"), "w").write("half done")
if rank == 1:
    # Fail once rank 0 has written its part too, however slowly it started.
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(out, "partial-0.txt")) and time.time() < deadline:
        time.sleep(0.05)
    print("rank 1: the data file is corrupt", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(600)
"""


def test_a_failing_rank_fails_the_job_with_its_rank_node_and_log_tail(env: ScriptEnv) -> None:
    env.agent("solo", slots=2)
    code = env.upload_code({"fail.py": FAILING})
    job_id = env.submit(code, ["python", "fail.py"], resources={"node_count": 1, "process_count_per_node": 2})
    job = env.wait(job_id, timeout=60)
    assert job["status"] == "failed", job
    failure = job["failure"]
    assert failure["code"] == "RankFailedError" and failure["rank"] == 1 and failure["node"] == "solo"
    assert "exited with code 3" in failure["message"]
    assert "the data file is corrupt" in failure["traceback"]
    # Node 0's outputs are kept on failure too; rank 0 (sleeping) was stopped.
    assert set(env.outputs(job_id)) == {"partial-0.txt", "partial-1.txt"}


SPAWNER = """
import os, subprocess, sys, time
marker = sys.argv[1]  # on every child's command line: the test finds them by it
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
# A grandchild in a session of its own, ignoring SIGTERM: only the run marker finds it.
orphan = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
     marker],
    start_new_session=True,
)
# A double-forked sleeper in a new session with an empty environment: no marker finds it,
# the sandbox's PID namespace ends it.
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execve("/bin/sleep", ["sleep", "600", marker], {})
    os._exit(0)
os.wait()
print(f"children {child.pid} {orphan.pid}", flush=True)
time.sleep(600)
"""


def test_cancel_stops_the_script_and_its_children(env: ScriptEnv) -> None:
    env.agent("solo", slots=1, grace_period=2.0)
    code = env.upload_code({"spawn.py": SPAWNER})
    job_id = env.submit(code, ["python", "spawn.py", job_id_marker := "spawn-marker-7f3a"])
    deadline = time.monotonic() + 60
    pids: list[int] = []
    while time.monotonic() < deadline and not pids:
        text = env.log(job_id, rank=0)
        if "children" in text:
            pids = [int(p) for p in text.split("children", 1)[1].split()[:2]]
        time.sleep(0.2)
    assert pids, env.log(job_id, rank=0)
    # The script, its two children and the sleeper (and the sandbox, naming the script).
    assert len(processes_mentioning(job_id_marker)) >= 4, processes_mentioning(job_id_marker)
    r = env.user.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200, r.text
    job = env.wait(job_id, timeout=60)
    assert job["status"] == "cancelled"
    assert wait_until_gone(job_id_marker) == []


AS_IT_IS = """
import os, pathlib
import mlflow, torch
from torch.utils.tensorboard import SummaryWriter

rank = int(os.environ["RANK"])
mlflow.set_experiment("digits")
with mlflow.start_run(run_name=f"rank{rank}") as run:
    mlflow.log_params({"lr": 0.1, f"only_{rank}": rank})
    mlflow.set_tag("team", "vision")
    for step in range(3):
        mlflow.log_metric("loss", rank + 1.0 / (step + 1), step=step)
    mlflow.log_metrics({"acc": 0.5, "top 5": 0.9})
    mlflow.log_metric("again", 1.0)  # no step: MLflow's client sends step 0, both kept
    mlflow.log_metric("again", 2.0)
    notes = pathlib.Path(f"notes-{rank}.txt")
    notes.write_text(f"notes of rank {rank}")
    mlflow.log_artifact(str(notes))
writer = SummaryWriter()  # ./runs/<date>_<host>: under the process's working copy
for step in range(4):
    writer.add_scalar("tb/loss", 2.0 - step / 2, step)
writer.close()
pathlib.Path("logs", f"state-{rank}.bin").write_bytes(bytes([0, 1, rank]))
torch.save({"w": torch.zeros(1)}, f"model-{rank}.pt")  # not under outputs/: named, not kept
"""


def test_mlflow_tensorboard_and_logs_of_an_unmodified_script_1x2(env: ScriptEnv) -> None:
    """docs/script-jobs.md: what a script logs through MLflow and TensorBoard becomes the job's metrics
    (with the process's rank), params and tags show on the job, artifacts and ./logs are in
    the outputs, and model files left in the working copy are named in the job's log."""
    env.agent("solo", slots=2)
    code = env.upload_code({"train.py": AS_IT_IS})
    job_id = env.submit(
        code, ["python", "train.py"], resources={"node_count": 1, "process_count_per_node": 2}
    )
    job = env.wait(job_id)
    assert job["status"] == "succeeded", (job, env.log(job_id, stream="agent"))
    loss = _metrics(env, job_id, "loss")
    assert [(r, s) for r, s, _ in loss] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [v for _, _, v in loss] == pytest.approx([1.0, 0.5, 1 / 3, 2.0, 1.5, 1 + 1 / 3])
    assert _metrics(env, job_id, "again") == [(0, 0, 1.0), (0, 0, 2.0), (1, 0, 1.0), (1, 0, 2.0)]
    assert _metrics(env, job_id, "top_5") == [(0, 0, 0.9), (1, 0, 0.9)]
    assert _metrics(env, job_id, "tb/loss") == [(r, s, 2.0 - s / 2) for r in (0, 1) for s in range(4)]
    tracking = job["tracking"]
    assert tracking["params"] == {"lr": "0.1", "only_0": "0", "only_1": "1"}
    assert tracking["tags"] == {"team": "vision"}
    assert [(r["name"], r["rank"], r["status"], r["experiment"]) for r in tracking["runs"]] == [
        ("rank0", 0, "FINISHED", "digits"),
        ("rank1", 1, "FINISHED", "digits"),
    ]
    files = env.outputs(job_id)
    for run in tracking["runs"]:
        rank = run["rank"]
        assert files[f"mlflow/{run['id']}/artifacts/notes-{rank}.txt"] == f"notes of rank {rank}".encode()
        assert files[f"logs/state-{rank}.bin"] == bytes([0, 1, rank])
    one = env.user.get(f"/v1/jobs/{job_id}/outputs", params={"path": "logs/state-1.bin"})
    assert one.status_code == 200 and one.content == bytes([0, 1, 1])
    agent_log = env.log(job_id, stream="agent")
    for rank in (0, 1):
        assert f"not kept: model-{rank}.pt was written in the working copy of rank-{rank}" in agent_log
        assert f"logs: state-{rank}.bin is not a log stream (not a text file" in agent_log


LIGHTNING = """
import os, sys
import lightning as L
import mlflow
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger


class Linear(L.LightningModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


devices = int(sys.argv[1])
torch.manual_seed(0)
x = torch.randn(64, 4)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
trainer = L.Trainer(
    accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=1,
    log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
    logger=[MLFlowLogger(experiment_name="lightning", prefix="mlflow"),
            TensorBoardLogger("tb_logs", prefix="tb"), CSVLogger(".")],
)
trainer.fit(Linear(), torch.utils.data.DataLoader(data, batch_size=8))
# Lightning's loggers write from rank 0 only; a rank may still call MLflow itself.
with mlflow.start_run(run_name=f"rank{trainer.global_rank}"):
    mlflow.log_metric("rank_seen", float(trainer.global_rank))
"""


def test_lightning_mlflow_and_tensorboard_loggers_1_and_2_processes(env: ScriptEnv) -> None:
    """docs/script-jobs.md: Lightning's ``MLFlowLogger``, ``TensorBoardLogger`` and ``CSVLogger``,
    unchanged, in a 1-process job and a 2-process ``per_node`` job (``torchrun`` starting
    Lightning's DDP ranks): what they log is the job's metrics, with the rank of the process
    that logged; the working copy's ``lightning_logs/`` is in the outputs."""
    pytest.importorskip("lightning")
    env.agent("solo", slots=3)
    code = env.upload_code({"fit.py": LIGHTNING})
    one = env.submit(
        code, ["python", "fit.py", "1"], resources={"node_count": 1, "process_count_per_node": 1}
    )
    two = env.submit(
        code,
        ["torchrun", "--nnodes", "$NNODES", "--nproc-per-node", "$NPROC_PER_NODE", "--node-rank",
         "$NODE_RANK", "--master-addr", "$MASTER_ADDR", "--master-port", "$MASTER_PORT", "fit.py",
         "$NPROC_PER_NODE"],
        distribution={"launch": "per_node"},
        resources={"node_count": 1, "process_count_per_node": 2},
    )  # fmt: skip
    for job_id, steps, ranks in ((one, 8, [0]), (two, 4, [0, 1])):
        job = env.wait(job_id)
        assert job["status"] == "succeeded", (job, env.log(job_id, stream="agent"))
        mlflow_loss = _metrics(env, job_id, "mlflow-train_loss")
        tb_loss = _metrics(env, job_id, "tb-train_loss")
        # 64 samples in batches of 8, split between the ranks; rank 0 logs every step.
        assert [(r, s) for r, s, _ in mlflow_loss] == [(0, s) for s in range(steps)], mlflow_loss
        assert [(r, s) for r, s, _ in tb_loss] == [(0, s) for s in range(steps)], tb_loss
        assert [v for _, _, v in tb_loss] == pytest.approx([v for _, _, v in mlflow_loss], rel=1e-6)
        # CSVLogger's ./lightning_logs/version_0/metrics.csv: read as metrics, kept in the outputs.
        csv_loss = _metrics(env, job_id, "train_loss")
        assert [(r, s) for r, s, _ in csv_loss] == [(0, s) for s in range(steps)], csv_loss
        assert [v for _, _, v in csv_loss] == pytest.approx([v for _, _, v in mlflow_loss], rel=1e-6)
        assert b"train_loss" in env.outputs(job_id)["lightning_logs/version_0/metrics.csv"]
        assert "not kept: lightning_logs/" not in env.log(job_id, stream="agent")
        # Each rank's own MLflow call carries its rank (per_node: the RANK torchrun gave it).
        assert _metrics(env, job_id, "rank_seen") == [(r, 0, float(r)) for r in ranks]
        assert job["tracking"]["params"]["lr"] == "0.1"
        assert {r["experiment"] for r in job["tracking"]["runs"]} >= {"lightning"}
