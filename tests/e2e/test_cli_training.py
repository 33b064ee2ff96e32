"""A user's whole session with the CLI against ``torchyard serve --with-worker``: real
training (torchrun + DDP on CPU), ``logs -f`` ending with the job, the model
downloaded and verified, and ``predict`` agreeing with the service's validation top-1."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
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


class Serve:
    def __init__(self, tmp: Path) -> None:
        self.data_dir = tmp / "data"
        self.port = free_port()
        self.log = tmp / "serve.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        # No token anywhere: the CLI finds the admin token in the data directory.
        self.env.update(TORCHYARD_DATA_DIR=str(self.data_dir), TORCHYARD_URL=f"http://127.0.0.1:{self.port}")
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
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

    def wait_ready(self, timeout: float = 120) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.tail()
            r = self.cli("cluster", "--json", timeout=60)
            if r.returncode == 0:
                cluster: dict[str, object] = json.loads(r.stdout)
                if cluster["ready_nodes"] == 1:
                    return cluster
            assert time.monotonic() < deadline, f"not ready: {r.stderr}\n{self.tail()}"
            time.sleep(0.5)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    s = Serve(tmp_path)
    yield s
    if s.process.poll() is None:
        s.process.kill()
        s.process.wait(10)


def test_train_follow_download_and_predict_with_the_cli(serve: Serve, tmp_path: Path) -> None:
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
    assert [row.split()[0] for row in table[1:]] == ["1", "2"]

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
