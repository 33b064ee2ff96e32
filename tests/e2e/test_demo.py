"""``torchyard demo``, the README's first command, run as a user runs it (small and short)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cli_training import processes_mentioning

pytestmark = pytest.mark.slow


def test_demo_trains_downloads_and_explains_how_to_go_on(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    result = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "demo", "--epochs", "2", "--per-class", "12"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    out = result.stdout
    demo = tmp_path / "torchyard-demo"
    serve_log = (demo / "serve.log").read_text(errors="replace") if (demo / "serve.log").exists() else ""
    assert result.returncode == 0, f"{out}\n{result.stderr}\n--- serve.log ---\n{serve_log[-5000:]}"

    lines = out.splitlines()
    assert lines[0].startswith("torchyard demo: API + local worker on http://127.0.0.1:")
    assert re.search(r"^worker node '.+' ready: \d+ cpu unit\(s\)$", out, re.M)
    assert "uploaded digits-train (100 images) and digits-val (20 images), 10 classes" in out
    # live progress: every status, and one line per epoch with its metrics
    statuses = [line.split()[1] for line in lines if line.startswith("status: ")]
    assert statuses == ["queued", "scheduled", "running", "succeeded"]
    epochs = [line for line in lines if re.match(r"^epoch \d/2  ", line)]
    assert [e.split()[1] for e in epochs] == ["1/2", "2/2"]
    assert all("val.top1" in e and "train.loss" in e for e in epochs)
    # the model directory, downloaded and verified, and checked locally
    match = re.search(r"^model directory downloaded and verified: (\S+) \(sha256 [0-9a-f]{64}\)$", out, re.M)
    assert match, out
    model_dir = tmp_path / match.group(1)
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "SHA256SUMS").is_file()
    reported = re.search(r"^final top-1 \(validation\): (\d+\.\d\d)% \(best epoch \d\)$", out, re.M)
    local = re.search(
        r"^local check with torchyard.modeldir: top-1 (\d+\.\d\d)% \((\d+)/20 validation images\)$", out, re.M
    )
    assert reported and local, out
    assert reported.group(1) == local.group(1)  # the loader reproduces the service's number
    # how to go on: the URL, where the token is, and the next commands
    assert "admin token:   torchyard-demo/data/admin.token" in out
    assert (demo / "data" / "admin.token").is_file()
    assert "TORCHYARD_DATA_DIR=torchyard-demo/data torchyard serve --with-worker" in out
    assert re.search(
        r"^    torchyard predict torchyard-demo/models/\w+ torchyard-demo/digits/val/7/\S+\.png", out, re.M
    )
    # and the service was shut down cleanly, its worker with it
    assert lines[-1] == "service stopped."
    assert processes_mentioning(str(demo.resolve())) == []
