"""``torchyard demo``, the README's first command, run as a user runs it (small and short)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_cli_training import processes_mentioning

pytestmark = pytest.mark.slow


KEPT = "the service keeps running: web UI at "


def _ctrl_c_reaches_it() -> None:
    """In the demo's process, before it starts: SIGINT handled as in a terminal. A suite
    started in the background by a non-interactive shell has SIGINT ignored, and a child
    inherits that; the user's Ctrl-C this test stands for would then never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_demo_trains_downloads_and_explains_how_to_go_on(tmp_path: Path) -> None:
    """Run with --keep-running: the web UI answers at the URL the demo prints once it is
    done, and Ctrl-C then stops the service."""
    # Its output goes to a pipe: no terminal width to fit (COLUMNS, which xdist sets, would give one).
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_") and k != "COLUMNS"}
    errors = (tmp_path / "stderr.txt").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchyard.cli",
            "demo",
            "--epochs",
            "2",
            "--per-class",
            "12",
            "--keep-running",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        preexec_fn=_ctrl_c_reaches_it,
    )
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(process.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 900
    while not any(line.startswith(KEPT) for line in printed) and process.poll() is None:
        assert time.monotonic() < deadline, "".join(printed)
        time.sleep(0.5)
    kept = next((line for line in printed if line.startswith(KEPT)), None)
    if kept is not None:
        ui_url = kept[len(KEPT) :].split(",")[0]
        page = httpx.get(ui_url, timeout=30)
        assert page.status_code == 200 and "torchyard" in page.text
        process.send_signal(signal.SIGINT)
    try:
        process.wait(120)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(30)
    out = "".join(printed)
    demo = tmp_path / "torchyard-demo"
    serve_log = (demo / "serve.log").read_text(errors="replace") if (demo / "serve.log").exists() else ""
    errors.close()
    stderr = (tmp_path / "stderr.txt").read_text(errors="replace")
    assert kept is not None and process.returncode == 0, (
        f"{out}\n{stderr}\n--- serve.log ---\n{serve_log[-5000:]}"
    )

    lines = out.splitlines()
    assert lines[0].startswith("torchyard demo: API + local worker on http://127.0.0.1:")
    assert re.search(r"^worker node '.+' ready: \d+ cpu unit\(s\)$", out, re.M)
    assert re.search(
        r"^web UI: http://127\.0\.0\.1:\d+/ while the demo runs \(sign in with the token in ", out, re.M
    )
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
    # the job by its id (a second run makes the name ambiguous), the web UI by its URL
    job_id = re.search(r"^submitted job ([0-9a-f]+):", out, re.M)
    assert job_id and f"    torchyard metrics {job_id.group(1)[:8]} " in out
    assert re.search(r"^  web UI:        http://127\.0\.0\.1:\d+/ \(up until you press Ctrl-C", out, re.M)
    # and the service was shut down cleanly, its worker with it
    assert lines[-1] == "service stopped."
    assert processes_mentioning(str(demo.resolve())) == []
