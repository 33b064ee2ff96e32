"""How a ``torchyard worker`` agent starts and stops before it has any work: it registers
without loading torch (only the ranks it launches do), and a SIGTERM while it is still
trying to reach the API stops it at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import LiveServer, free_port
from tests.support.factories import auth
from tests.support.worker_fixtures import wait_for_node, worker_token
from worker.agent.node import cuda_devices, detect_resources


def _agent(api_url: str, token: str, work_dir: Path, *options: str) -> subprocess.Popen[bytes]:
    work_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchyard.cli",
            "worker",
            "--api",
            api_url,
            "--work-dir",
            str(work_dir),
            "--name",
            "n1",
            *options,
        ],
        env={**os.environ, "TORCHYARD_TOKEN": token},
        stdin=subprocess.DEVNULL,
        stdout=(work_dir / "agent.log").open("ab"),
        stderr=subprocess.STDOUT,
    )


def _mapped_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as fh:
        return {Path(line.split()[-1]).name for line in fh if "/" in line}


def test_the_agent_registers_without_loading_torch(live_server: LiveServer, tmp_path: Path) -> None:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30) as admin:
        # No --cpu: the agent looks for GPUs itself, through the driver library, not torch.
        agent = _agent(live_server.url, worker_token(admin), tmp_path / "w")
        try:
            node = wait_for_node(admin, "n1", timeout=30)
            libraries = _mapped_libraries(agent.pid)
            log = (tmp_path / "w" / "agent.log").read_text()
        finally:
            agent.kill()
            agent.wait(10)
    count, _ = cuda_devices()
    assert node["accelerator"] == "cpu" if count == 0 else node["accelerator"].startswith("cuda:")
    assert node["units"] >= 1
    assert libraries, "the agent's memory map could not be read"
    loaded_torch = sorted(name for name in libraries if name.startswith(("libtorch", "libc10")))
    assert loaded_torch == [], f"the agent mapped {loaded_torch} before any work:\n{log}"


def test_gpus_are_found_without_torch_in_the_process() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; from worker.agent.node import cuda_devices, detect_resources;"
            "r = detect_resources(3); print(json.dumps([list(cuda_devices()), r.units, r.accelerator,"
            " 'torch' in sys.modules]))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (count, name), units, accelerator, torch_loaded = json.loads(out.stdout)
    assert torch_loaded is False
    if count == 0:
        assert (units, accelerator, name) == (3, "cpu", "")
    else:
        assert (units, accelerator) == (count, f"cuda:{name}"[:64])
    # --cpu registers CPU slots whatever the node has.
    forced = detect_resources(2, force_cpu=True)
    assert (forced.units, forced.accelerator, forced.gpu_ids) == (2, "cpu", ())


def test_sigterm_while_the_api_is_unreachable_stops_the_agent(tmp_path: Path) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    agent = _agent(unreachable, "ty_worker_token_never_checked", tmp_path / "w", "--cpu")
    try:
        log_path = tmp_path / "w" / "agent.log"
        deadline = time.monotonic() + 30
        while "registering node n1" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has failed to reach the API at least once
        assert agent.poll() is None, log_path.read_text()
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(timeout=10)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
    assert rc == 0, log_path.read_text()
    assert "stopped before the node could register" in log_path.read_text()
