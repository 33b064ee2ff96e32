"""A user's whole session with the CLI against ``torchyard serve --with-worker``: real
training (torchrun + DDP on CPU), ``logs -f`` ending with the job, the model
downloaded and verified, and ``predict`` agreeing with the service's validation top-1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.support import REPO_ROOT
from torchyard.sample_data import write_digits

pytestmark = pytest.mark.slow


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions ``text`` (the data dir names every child we start)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (an exited child nobody reaped is a zombie, not live)."""
    try:
        stat_fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat_fields[0] != "Z"


class Serve:
    def __init__(self, tmp: Path) -> None:
        self.data_dir = tmp / "data"
        self.port = free_port()
        self.log = tmp / "serve.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        # No token anywhere: the CLI finds the admin token in the data directory.
        self.env.update(TORCHYARD_DATA_DIR=str(self.data_dir), TORCHYARD_URL=f"http://127.0.0.1:{self.port}")
        self.process = self._start("wb")

    def _start(self, mode: str) -> subprocess.Popen[bytes]:
        with open(self.log, mode) as out:
            return subprocess.Popen(
                [sys.executable, "-m", "torchyard.cli", "serve", "--with-worker", "--port", str(self.port),
                 "--worker-slots", "2"],
                env=self.env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "torchyard.cli", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def ok(self, *args: str, timeout: float = 300) -> str:
        r = self.cli(*args, timeout=timeout)
        assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}\n{self.tail()}"
        return r.stdout

    def tail(self) -> str:
        return "--- serve log ---\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def get(self, path: str) -> Any:
        """``GET path`` as the admin over HTTP (the waits poll with this, not with a CLI
        process a time: the commands under test are run by :meth:`cli`); None while
        ``serve`` does not answer."""
        token = self.data_dir / "admin.token"
        if not token.is_file():
            return None
        try:
            r = httpx.get(
                f"http://127.0.0.1:{self.port}{path}",
                headers={"Authorization": f"Bearer {token.read_text().strip()}"},
                timeout=30,
            )
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 else None

    def wait_ready(self, timeout: float = 120) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.tail()
            cluster = self.get("/v1/cluster")
            if cluster is not None and cluster["ready_nodes"] == 1:
                # The CLI sees the same.
                shown: dict[str, object] = json.loads(self.ok("cluster", "--json", timeout=60))
                return shown
            assert time.monotonic() < deadline, f"not ready: {cluster}\n{self.tail()}"
            time.sleep(0.5)

    def kill_and_restart(self) -> None:
        """SIGKILL ``serve`` and start it again at once on the same port and data directory,
        as an operator's quick restart: its worker, told by the kernel that its parent died,
        is still stopping its runs when the new ``serve`` starts its own."""
        self.process.kill()
        self.process.wait(10)
        self.process = self._start("ab")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """One `torchyard serve --with-worker` for the module (the last test stops it)."""
    s = Serve(tmp_path_factory.mktemp("serve"))
    yield s
    if s.process.poll() is None:
        s.process.kill()
        s.process.wait(10)


def _readme_blocks() -> list[str]:
    """The shell blocks of the README's "Using it" section."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = re.search(r"^## Using it\n(.*?)(?=^## )", readme, re.S | re.M)
    assert section
    return re.findall(r"```sh\n(.*?)```", section.group(1), re.S)


def _session_folder(root: Path) -> Path:
    """A folder as the README's reader has it: ``.venv`` (here its activate script puts this
    interpreter's folder on PATH), ``examples/job.yaml`` and the demo's digits, each class cut
    to a few images so that the session trains in seconds."""
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    (root / "examples").mkdir()
    shutil.copy(REPO_ROOT / "examples" / "job.yaml", root / "examples" / "job.yaml")
    train, val = write_digits(root / "torchyard-demo" / "digits", size=32)  # as `torchyard demo` does
    keep = {"train": 8, "val": 4}
    for split, folder in (("train", train), ("val", val)):
        for label in folder.iterdir():
            for extra in sorted(label.glob("*.png"))[keep[split] :]:
                if extra.name != "digit-0017.png":  # the README's own image stays
                    extra.unlink()
    return root


def test_the_readmes_using_it_session_runs_as_pasted(serve: Serve, tmp_path: Path) -> None:
    """The README's service block is what this module's server runs; its session block,
    pasted into bash against that server, runs from the upload to the predictions."""
    service, session = _readme_blocks()[:2]  # (a script job's block follows)
    assert [line.split("#")[0].strip() for line in service.strip().splitlines()] == [
        "source .venv/bin/activate",
        "torchyard serve --with-worker",  # (here on a free port, with 2 slots)
    ]
    serve.wait_ready()
    folder = _session_folder(tmp_path / "clone")
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", session],
        cwd=folder, env=serve.env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}\n{serve.tail()}"
    # The two datasets' ids (the job's went into $JOB); the job is the newest.
    assert len([line for line in ran.stdout.splitlines() if re.fullmatch(r"[0-9a-f]{32}", line)]) == 2
    job = json.loads(serve.ok("jobs", "--json"))[0]
    job = json.loads(serve.ok("show", job["id"], "--json"))
    assert job["status"] == "succeeded" and job["parameters"]["epochs"] == 3
    assert job["name"] == "digits-resnet18" and job["tags"] == ["baseline"]
    # `torchyard jobs`: the job's progress and ETA (done: 100 %, nothing left).
    table = serve.ok("jobs").splitlines()
    assert table[0].split()[:5] == ["ID", "NAME", "STATUS", "PROGRESS", "ETA"]
    row = next(line for line in table[1:] if line.startswith(job["id"]))
    assert row.split()[2:7] == ["succeeded", "epoch", "3/3", "100%", "0s"], row
    assert (folder / "model" / "config.json").is_file()
    predictions = [
        line for line in ran.stdout.splitlines() if line.startswith("torchyard-demo/digits/val/7/")
    ]
    assert len(predictions) == 2, ran.stdout  # the local model directory, then the service
    assert re.search(r"^digits:\d+$", ran.stdout, re.M), ran.stdout


def test_a_quick_restart_of_serve_while_a_job_runs_loses_neither_the_node_nor_the_job(
    serve: Serve, tmp_path: Path
) -> None:
    """``serve`` SIGKILLed and started again at once while a job trains: the old worker, still
    preempting its placement, holds the node's lock; the new worker waits for it instead of
    exiting with NodeNameInUseError, registers, and the job resumes from its checkpoint and
    succeeds, its preemption not counted as a restart."""
    serve.wait_ready()
    train_dir, val_dir = write_digits(tmp_path / "digits", per_class=6, size=16)
    serve.ok("datasets", "upload", str(train_dir), "--name", "restart-train")
    serve.ok("datasets", "upload", str(val_dir), "--name", "restart-val")
    job_id = serve.ok(
        "submit", "--train", "restart-train", "--val", "restart-val", "--arch", "resnet18",
        "--image-size", "16", "--epochs", "3", "--batch-size", "8", "--lr", "0.05",
        "--name", "quick-restart",
    ).strip()  # fmt: skip
    deadline = time.monotonic() + 300
    while (serve.get(f"/v1/jobs/{job_id}") or {}).get("status") != "running":
        assert time.monotonic() < deadline, serve.tail()
        time.sleep(0.5)
    old_workers = [  # serve's worker agent, its child
        pid
        for pid in processes_mentioning(f"--work-dir {serve.data_dir}/worker")
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(serve.process.pid)
    ]
    assert old_workers, "no worker agent process"

    serve.kill_and_restart()
    deadline = time.monotonic() + 600
    while True:
        job = serve.get(f"/v1/jobs/{job_id}") or {"status": "unknown"}  # none while serve starts
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        assert time.monotonic() < deadline, serve.tail()
        time.sleep(1)
    job = json.loads(serve.ok("show", job_id, "--json"))
    assert job["status"] == "succeeded", (job, serve.tail())
    assert job["restarts"] == 0 and len(job["attempts"]) >= 2, json.dumps(job["attempts"])
    # The old worker has finished stopping; the node is the new worker's, which holds its lock.
    assert not [pid for pid in old_workers if _running(pid)]
    cluster = serve.wait_ready()
    assert cluster["ready_nodes"] == 1
    (lock,) = Path(f"{serve.data_dir}/worker").glob("*.lock")
    holder = int(lock.read_text())
    assert holder not in old_workers and _running(holder)
    worker_log = (serve.data_dir / "logs" / "local-worker.log").read_text(errors="replace")
    assert "is still stopping: waiting up to" in worker_log, worker_log[-3000:]
    assert "NodeNameInUse" not in worker_log + serve.log.read_text(errors="replace")


def test_fine_tuning_from_weights_uploaded_with_the_cli(serve: Serve, tmp_path: Path) -> None:
    """docs/fine-tuning.md: ``pretrained: true`` is refused at submission while no weights are
    stored; ``torchyard weights upload`` refuses a file whose name carries another sha256
    prefix and stores one that carries its own; the job then starts from those weights."""
    import hashlib

    import torch
    import torchvision

    serve.wait_ready()
    train_dir, val_dir = write_digits(tmp_path / "digits", per_class=6, size=16)
    serve.ok("datasets", "upload", str(train_dir), "--name", "tune-train")
    serve.ok("datasets", "upload", str(val_dir), "--name", "tune-val")
    submit = ("submit", "--train", "tune-train", "--val", "tune-val", "--arch", "mobilenet_v3_small",
              "--pretrained", "--image-size", "16", "--epochs", "1", "--batch-size", "8",
              "--name", "fine-tune")  # fmt: skip
    refused = serve.cli(*submit)
    assert refused.returncode != 0 and "torchyard weights upload mobilenet_v3_small FILE" in refused.stderr

    torch.manual_seed(11)  # stands in for published ImageNet weights
    state = torchvision.models.mobilenet_v3_small(num_classes=1000).state_dict()
    plain = tmp_path / "weights.pth"
    torch.save(state, plain)
    sha = hashlib.sha256(plain.read_bytes()).hexdigest()
    misnamed = tmp_path / "mobilenet_v3_small-deadbeef.pth"
    shutil.copy(plain, misnamed)
    wrong = serve.cli("weights", "upload", "mobilenet_v3_small", str(misnamed), "--no-check")
    assert wrong.returncode != 0 and "deadbeef" in wrong.stderr and sha in wrong.stderr, wrong.stderr
    named = tmp_path / f"mobilenet_v3_small-{sha[:8]}.pth"
    plain.rename(named)
    weights_id = serve.ok("weights", "upload", "mobilenet_v3_small", str(named)).strip()
    (listed,) = json.loads(serve.ok("weights", "list", "--json"))
    assert (listed["id"], listed["sha256"]) == (weights_id, sha)

    job_id = serve.ok(*submit).strip()
    log_text = serve.ok("logs", job_id, "-f")  # ends with the job
    job = json.loads(serve.ok("show", job_id, "--json"))
    assert job["status"] == "succeeded", (job, log_text[-3000:])
    assert f"starting from the stored weights (sha256 {sha})" in log_text, log_text[-3000:]


def test_train_follow_download_and_predict_with_the_cli(serve: Serve, tmp_path: Path) -> None:
    # Runs last: it stops the module's server.
    cluster = serve.wait_ready()
    node = cluster["nodes"][0]  # type: ignore[index]
    assert node["units"] == 2 and node["name"].endswith("-local")
    token_file = serve.data_dir / "worker.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((serve.data_dir / "admin.token").stat().st_mode) == 0o600

    train_dir, val_dir = write_digits(tmp_path / "digits", per_class=12, size=32)
    serve.ok("datasets", "upload", str(train_dir), "--name", "digits-train")
    serve.ok("datasets", "upload", str(val_dir), "--name", "digits-val")
    job_id = serve.ok(
        "submit", "--train", "digits-train", "--val", "digits-val", "--arch", "resnet18",
        "--image-size", "32", "--augmentation", "light", "--epochs", "2", "--batch-size", "16",
        "--lr", "0.05", "--print-frequency", "2", "--name", "cli-e2e",
    ).strip()  # fmt: skip
    follow = subprocess.Popen(
        [sys.executable, "-m", "torchyard.cli", "logs", job_id, "-f"],
        env=serve.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watch = serve.cli("metrics", job_id, "--watch", timeout=600)
    assert watch.returncode == 0, watch.stderr + serve.tail()
    assert (
        watch.stdout.strip().splitlines()[-1]
        == "status: succeeded (training finished on " + node["name"] + ")"
    )
    log_text, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    assert log_text == serve.ok("logs", job_id)  # the follower got the whole stream, then ended
    assert "epoch 2/2 done" in log_text

    job = json.loads(serve.ok("show", job_id, "--json"))
    assert job["status"] == "succeeded"
    table = serve.ok("metrics", job_id).splitlines()
    # A row per epoch (and, under them, the metrics that did not fit: "+3 more metrics: ...").
    assert [row.split()[0] for row in table[1:] if not row.startswith("+")] == ["1", "2"]

    model = tmp_path / "model"
    assert serve.ok("download", job_id, "-o", str(model)).strip() == str(model)
    config = json.loads((model / "config.json").read_text())
    assert config["architecture"] == "resnet18" and config["classes"] == [str(i) for i in range(10)]

    # predict, with no service involved, agrees with the service's validation of the saved epoch
    images = sorted(val_dir.glob("*/*.png"))
    predicted = json.loads(serve.ok("predict", str(model), *map(str, images), "--topk", "1", "--json"))
    correct = sum(p["top"][0]["label"] == Path(p["file"]).parent.name for p in predicted)
    assert correct / len(images) == pytest.approx(job["best"]["val.top1"], abs=1e-9)

    # serve stops its worker, then itself; nothing of the session is left running
    assert serve.stop() == 0
    assert processes_mentioning(str(serve.data_dir)) == []
