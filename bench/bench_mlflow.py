"""MLflow from a script job (docs/script-jobs.md): the tracking endpoint's speed against a real
``mlflow server``, and 10,000 points kept exactly once across an API SIGKILL.

1. **Round trip.** A script (its own process, the real MLflow client) calls
   ``mlflow.log_metric`` ``--calls`` times in one run, one call after the other, against
   (a) torchyard's endpoint as an agent runs it for a placement (``TrackingEndpoint``,
   writing each point to the metrics file before answering) and (b) a real
   ``mlflow server`` with a SQLite backend on the same machine. The two alternate
   ``--rounds`` times in this one run; printed: calls/s of each round, the medians, and
   the ratio torchyard / MLflow (goal ≥ 1.0).
2. **Exactly once across an API restart.** A script job (one real ``torchyard serve``
   process with SQLite, one real worker agent) logs ``--points`` points with
   ``mlflow.log_metric(step=i)``; once some are stored, the API is SIGKILLed, kept down
   ``--outage`` seconds and started again. Printed: points expected / stored /
   duplicated / missing (the history with ``include_superseded=true``) and the job's status.

Usage (from the repository root; the test helpers are reused; ``mlflow server`` comes
from the full ``mlflow`` package, installed where ``--mlflow`` points, e.g. a virtual
environment of its own)::

    python -m bench.bench_mlflow --mlflow /path/to/venv/bin/mlflow
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.bench_api_outage import get, stored_points
from tests.support.api_process import ApiProcess
from tests.support.factories import auth
from tests.support.worker_fixtures import start_agent, user_client, wait_for_node, worker_token
from worker.agent.mlflow_endpoint.server import TrackingEndpoint

CLIENT = """
import sys, time, mlflow
calls = int(sys.argv[1])
mlflow.set_experiment("bench")
with mlflow.start_run():
    for i in range(20):
        mlflow.log_metric("warmup", float(i), step=i)
    start = time.perf_counter()
    for i in range(calls):
        mlflow.log_metric("m", float(i), step=i)
    rate = calls / (time.perf_counter() - start)
print("RATE", rate)
"""

JOB = """
import sys, time, mlflow
n = int(sys.argv[1])
with mlflow.start_run():
    for i in range(n):
        mlflow.log_metric("m", float(i), step=i)
        if i % 100 == 99:
            time.sleep(0.1)  # spread over some seconds, so the API dies in the middle
"""
FINAL = {"succeeded", "failed", "cancelled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def client_rate(uri: str, calls: int, token: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_TRACKING_URI"] = uri
    if token:
        env["MLFLOW_TRACKING_TOKEN"] = token
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, str(calls)], env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("RATE ")))


def round_trip(
    mlflow_bin: str, calls: int, rounds: int, tmp: Path, workers: int
) -> tuple[list[float], list[float]]:
    run_dir = tmp / "endpoint"
    (run_dir / "outputs").mkdir(parents=True)
    endpoint = TrackingEndpoint(run_dir, run_dir / "outputs", node_rank=0)
    endpoint.start()
    token = endpoint.env_for(0, "rank-0")["MLFLOW_TRACKING_TOKEN"]
    port = free_port()
    server_log = open(tmp / "mlflow-server.log", "wb")  # noqa: SIM115 - open while the server runs
    server = subprocess.Popen(
        [mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
         "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
         "--default-artifact-root", str(tmp / "mlflow-artifacts")],
        stdout=subprocess.DEVNULL, stderr=server_log, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError((tmp / "mlflow-server.log").read_text()[-3000:])
            time.sleep(0.5)
        ours, theirs = [], []
        for i in range(rounds):
            ours.append(client_rate(endpoint.uri, calls, token))
            theirs.append(client_rate(f"http://127.0.0.1:{port}", calls, None))
            print(
                f"  round {i + 1}: torchyard {ours[-1]:.0f} calls/s, mlflow server {theirs[-1]:.0f} calls/s"
            )
        return ours, theirs
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
        server_log.close()
        endpoint.stop()


def code_archive() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        raw = JOB.encode()
        info = tarfile.TarInfo("job.py")
        info.size = len(raw)
        tf.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def across_restart(points: int, outage: float, tmp: Path) -> dict[str, Any]:
    api = ApiProcess(tmp / "data", None).start().wait_ready()
    admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60)
    user = user_client(admin, api.url)
    agent = start_agent(api.url, worker_token(admin), "n1", tmp / "n1", slots=1)
    try:
        wait_for_node(user, "n1", timeout=120)
        r = user.post(
            "/v1/code", data={"name": "m"}, files={"file": ("src.tar.gz", code_archive(), "application/gzip")}
        )
        assert r.status_code == 201, r.text
        spec = {"type": "script", "code": r.json()["id"], "command": ["python", "job.py", str(points)],
                "resources": {"node_count": 1, "process_count_per_node": 1, "max_restarts": 0}}  # fmt: skip
        r = user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        deadline = time.monotonic() + 300
        while len(stored_points(user, job_id)[0]) < 200:
            assert time.monotonic() < deadline, user.get(f"/v1/jobs/{job_id}").text
            time.sleep(0.2)
        before = len(stored_points(user, job_id)[0])
        api.kill()
        print(f"  API SIGKILLed with {before} of {points} points stored", flush=True)
        time.sleep(outage)
        api.start()
        api.wait_ready(timeout=300)
        job: dict[str, Any] = {"status": "not final in time"}
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            answer = get(user, f"/v1/jobs/{job_id}")
            if answer is not None and answer.status_code == 200 and answer.json()["status"] in FINAL:
                job = answer.json()
                break
            time.sleep(0.5)
        stored, _ = stored_points(user, job_id)
        steps = Counter(p["step"] for p in stored if p["name"] == "m")
        return {
            "status": job["status"],
            "before_kill": before,
            "expected": points,
            "stored": sum(steps.values()),
            "duplicated": sum(c - 1 for c in steps.values() if c > 1),
            "missing": sum(1 for i in range(points) if i not in steps),
        }
    finally:
        agent.stop(timeout=60)
        api.terminate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mlflow", default="mlflow", help="the mlflow command that runs `mlflow server`")
    parser.add_argument("--calls", type=int, default=2000, help="log_metric calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="`mlflow server --workers` (one client calls)")
    parser.add_argument("--points", type=int, default=10_000)
    parser.add_argument("--outage", type=float, default=10.0, help="seconds the API stays down")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-mlflow-"))
    started = time.monotonic()
    print(f"round trip: {args.calls} log_metric calls a round, {args.rounds} rounds each, alternating")
    ours, theirs = round_trip(args.mlflow, args.calls, args.rounds, tmp, args.workers)
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"exactly once: {args.points} points, the API down {args.outage:g} s in the middle")
    result = across_restart(args.points, args.outage, tmp)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {time.monotonic() - started:.0f} s in all")
    print("| figure | value |")
    print("| --- | --- |")
    print(
        f"| torchyard endpoint, log_metric calls/s (median of {args.rounds}) | {statistics.median(ours):.0f} |"
    )
    print(
        f"| mlflow server (SQLite), log_metric calls/s (median of {args.rounds}) | {statistics.median(theirs):.0f} |"
    )
    print(f"| ratio torchyard / mlflow server (goal >= 1.0) | {ratio:.2f} |")
    print(
        f"| {result['expected']} points, API SIGKILLed after {result['before_kill']}: stored / duplicated / "
        f"missing, job status | {result['stored']} / {result['duplicated']} / {result['missing']}, {result['status']} |"
    )
    ok = ratio >= 1.0 and result["stored"] == result["expected"] and result["status"] == "succeeded"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
