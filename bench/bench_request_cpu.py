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
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from service.config import Settings
from tests.conftest import scratch_database
from tests.support.api_process import ApiProcess
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


def _measure_routes(
    args: argparse.Namespace, url: str, pid: int, admin_token: str, data_dir: Path, db_url: str
) -> dict[str, tuple[float, float]]:
    root = httpx.Client(base_url=url, headers=auth(admin_token))
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
        return user.post("/v1/jobs", json=job_spec(dataset, dataset, name=f"j{i}", resources=resources))

    for i in range(10):  # warm-up: imports, statement caches, the first pass
        submit(10_000 + i)
    idle = f"n{args.nodes - 1}"
    return {
        "POST /v1/jobs": _measure(pid, args.jobs, submit, (201,)),
        "heartbeat (no leases)": _measure(
            pid,
            args.beats,
            lambda _i: worker.post(f"/v1/worker/nodes/{idle}/heartbeat", json={"leases": []}),
            (200,),
        ),
        "claim that finds nothing (wait=0)": _measure(
            pid,
            args.claims,
            lambda _i: worker.post(f"/v1/worker/nodes/{idle}/claim", params={"wait": 0}),
            (204,),
        ),
        "GET /healthz": _measure(pid, args.beats, lambda _i: worker.get("/healthz"), (200,)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=200, help="submissions timed")
    parser.add_argument("--beats", type=int, default=1000, help="heartbeats and health checks timed")
    parser.add_argument("--claims", type=int, default=300, help="claims timed")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")

    with scratch_database("torchyard_cpu") as db_url, tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        data_dir = Path(tmp) / "data"
        api = ApiProcess(data_dir, db_url).start()
        try:
            api.wait_ready()
            assert api.proc is not None
            rows = _measure_routes(args, api.url, api.proc.pid, api.admin_token, data_dir, db_url)
        finally:
            api.terminate(60)
    print(f"{args.nodes} nodes, one API process, requests one after the other")
    print("| request | API CPU per request | client p50 |")
    print("| --- | --- | --- |")
    for what, (cpu_ms, p50_ms) in rows.items():
        print(f"| {what} | {cpu_ms:.2f} ms | {p50_ms:.2f} ms |")


if __name__ == "__main__":
    main()
