"""Agent start-up: from ``torchyard worker`` started to its node ready at the API.

A real API (uvicorn on loopback in this process, SQLite in a temporary folder) and a real
``torchyard worker --cpu`` subprocess, started ``--runs`` times (a new node name each
time). For each start the bench prints the wall time until ``GET /v1/cluster`` shows the
node ``ready``, the agent's CPU time then, and its resident memory.

Usage::

    python bench/bench_agent_start.py            # 5 starts
    python bench/bench_agent_start.py --runs 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from service.api.app import create_app
from service.config import Settings


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _proc_figures(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) and resident MiB of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return cpu, rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-agent-start-"))
    settings = Settings(data_dir=root / "data", database_url=f"sqlite:///{root / 'api.db'}")
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    admin_token = settings.admin_token_path.read_text().strip()
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=30)
    token = admin.post("/v1/tokens", json={"name": "bench", "role": "worker"}).json()["token"]

    walls, cpus, rss = [], [], []
    for i in range(args.runs):
        name = f"bench-{i}"
        started = time.perf_counter()
        command = [sys.executable, "-m", "torchyard.cli", "worker", "--api", url, "--name", name]
        agent = subprocess.Popen(
            [*command, "--cpu", "--work-dir", str(root / name)],
            env={**os.environ, "TORCHYARD_TOKEN": token},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while True:
                nodes = {n["name"]: n for n in admin.get("/v1/cluster").json()["nodes"]}
                if nodes.get(name, {}).get("status") == "ready":
                    break
                if agent.poll() is not None or time.perf_counter() - started > 120:
                    raise SystemExit(f"agent {name} did not register (exit {agent.poll()})")
                time.sleep(0.01)
            walls.append(time.perf_counter() - started)
            cpu, mib = _proc_figures(agent.pid)
            cpus.append(cpu)
            rss.append(mib)
        finally:
            agent.kill()
            agent.wait()
        print(
            f"start {i + 1}: ready after {walls[-1]:.2f} s, agent CPU {cpus[-1]:.2f} s, RSS {rss[-1]:.0f} MiB"
        )
    print(
        f"median over {args.runs}: ready after {statistics.median(walls):.2f} s, "
        f"agent CPU {statistics.median(cpus):.2f} s, RSS {statistics.median(rss):.0f} MiB"
    )
    server.should_exit = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
