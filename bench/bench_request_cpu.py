"""API CPU per request of the control plane's hot routes, on PostgreSQL.

Starts ``torchyard serve`` (one API process) on a fresh database of the local PostgreSQL
server, registers ``--nodes`` nodes, then sends each kind of request one after the other
and prints, per request, the API process's CPU time (user + system, from ``/proc``; Linux)
and the latency seen by the client:

- ``POST /v1/jobs`` (a job that waits: every node is drained, so nothing is placed);
- ``POST /v1/worker/nodes/{name}/heartbeat`` with no leases (a node running nothing);
- ``POST /v1/worker/nodes/{name}/claim?wait=0`` that finds nothing;
- ``GET /healthz``, the framework's floor.

Usage (from the repository root)::

    python -m bench.bench_request_cpu [--nodes 3] [--jobs 200] [--beats 1000]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import sqlalchemy as sa

from service.config import Settings
from tests.conftest import PG_ADMIN_URL, free_port
from tests.support.factories import auth, insert_dataset, job_spec


def _cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(
    pid: int, count: int, call: Callable[[int], httpx.Response], ok: tuple[int, ...]
) -> tuple[float, float]:
    """(API CPU ms per request, client p50 ms) over ``count`` requests, one after the other."""
    latencies = []
    before = _cpu_seconds(pid)
    for i in range(count):
        start = time.perf_counter()
        r = call(i)
        latencies.append(time.perf_counter() - start)
        assert r.status_code in ok, (r.status_code, r.text)
    used = _cpu_seconds(pid) - before
    return 1000 * used / count, 1000 * statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=200, help="submissions timed")
    parser.add_argument("--beats", type=int, default=1000, help="heartbeats and health checks timed")
    parser.add_argument("--claims", type=int, default=300, help="claims timed")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")

    name = f"torchyard_cpu_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    db_url = admin.url.set(database=name).render_as_string(hide_password=False)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        data_dir = Path(tmp) / "data"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        env.update({"TORCHYARD_DATA_DIR": str(data_dir), "TORCHYARD_DATABASE_URL": db_url})
        with open(Path(tmp) / "serve.log", "wb") as out:
            api = subprocess.Popen(
                [sys.executable, "-m", "torchyard.cli", "serve", "--port", str(port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/readyz", timeout=3).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert api.poll() is None and time.monotonic() < deadline, "the API did not start"
                time.sleep(0.2)
            root = httpx.Client(base_url=url, headers=auth((data_dir / "admin.token").read_text().strip()))
            user_token = root.post("/v1/tokens", json={"name": "bench", "role": "user"}).json()["token"]
            worker_token = root.post("/v1/tokens", json={"name": "nodes", "role": "worker"}).json()["token"]
            owner = root.get("/v1/whoami", headers=auth(user_token)).json()["id"]
            dataset = insert_dataset(Settings(data_dir=data_dir, database_url=db_url), owner)
            worker = httpx.Client(base_url=url, headers=auth(worker_token), timeout=60)
            for n in range(args.nodes):
                body = {"name": f"n{n}", "address": "127.0.0.1", "units": 1, "accelerator": "cpu"}
                worker.post("/v1/worker/nodes", json=body).raise_for_status()
            # Every node drained by its agent: still counted for the submissions' limits (heard from
            # within TORCHYARD_NODE_MEMORY_S), never placed onto, so every job waits and no
            # placement is handed out, expires or is reaped meanwhile.
            for n in range(args.nodes):
                worker.post(f"/v1/worker/nodes/n{n}/drain").raise_for_status()
            user = httpx.Client(base_url=url, headers=auth(user_token), timeout=60)
            resources = {"node_count": args.nodes, "process_count_per_node": 1, "max_restarts": 0}

            def submit(i: int) -> httpx.Response:
                return user.post(
                    "/v1/jobs", json=job_spec(dataset, dataset, name=f"j{i}", resources=resources)
                )

            for i in range(10):  # warm-up: imports, statement caches, the first pass
                submit(10_000 + i)
            idle = f"n{args.nodes - 1}" if args.nodes > 1 else "n0"
            rows = {
                "POST /v1/jobs": _measure(api.pid, args.jobs, submit, (201,)),
                "heartbeat (no leases)": _measure(
                    api.pid,
                    args.beats,
                    lambda _i: worker.post(f"/v1/worker/nodes/{idle}/heartbeat", json={"leases": []}),
                    (200,),
                ),
                "claim that finds nothing (wait=0)": _measure(
                    api.pid,
                    args.claims,
                    lambda _i: worker.post(f"/v1/worker/nodes/{idle}/claim", params={"wait": 0}),
                    (204,),
                ),
                "GET /healthz": _measure(api.pid, args.beats, lambda _i: worker.get("/healthz"), (200,)),
            }
        finally:
            api.terminate()
            try:
                api.wait(60)
            except subprocess.TimeoutExpired:
                api.kill()
                api.wait(10)
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()
    print(f"{args.nodes} nodes, one API process, requests one after the other")
    print("| request | API CPU per request | client p50 |")
    print("| --- | --- | --- |")
    for what, (cpu_ms, p50_ms) in rows.items():
        print(f"| {what} | {cpu_ms:.2f} ms | {p50_ms:.2f} ms |")


if __name__ == "__main__":
    main()
