"""Chaos on the control plane: short real jobs while the API is SIGKILLed and restarted
and its PostgreSQL stopped and started.

Starts a private PostgreSQL server (initdb into a temporary folder, a free port; as the
``postgres`` OS user when run as root), ``torchyard serve`` on it, and one real worker
agent, then submits ``--jobs`` short digits jobs (resnet18, 16 px) one after the other.
Meanwhile a chaos loop alternates, every ``--every`` seconds: SIGKILL the API, wait
``--api-down`` seconds, start it again; stop PostgreSQL for ``--db-down`` seconds, start
it again. A user polls the jobs all along (three routes, every 0.1 s).

Prints: jobs succeeded / failed or lost, the 5xx answers (500s apart), the longest
client-visible stall (the longest time the poller went without a 200 answer), and the
metric points lost or duplicated (each job's ``events.jsonl`` in the run directory
against ``GET /v1/jobs/{id}/metrics``).

Usage::

    python -m bench.bench_control_plane                 # 3 jobs, chaos every 12 s
    python -m bench.bench_control_plane --jobs 5 --every 8 --api-down 20 --db-down 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

# Run from the repository root with ``python -m``, which puts it on the path: the test
# helpers (a private PostgreSQL server, serve as a subprocess, a real agent) are reused.
from tests.support.api_process import ApiProcess
from tests.support.factories import auth, job_spec
from tests.support.private_pg import start_private_postgres
from tests.support.worker_fixtures import start_agent, upload_digits, user_client, worker_token

SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "1",
    "TORCHYARD_LEASE_TIMEOUT_S": "5",
    "TORCHYARD_REAPER_INTERVAL_S": "0.5",
    "TORCHYARD_MASTER_PORT_MIN": "33000",
    "TORCHYARD_MASTER_PORT_MAX": "33999",
}
FINAL = {"succeeded", "failed", "cancelled"}


class Poller:
    """A user polling jobs and following their metric points: status codes (0: the
    connection was refused), the longest time without a 200, and the points the follower
    received twice (the same ``(name, epoch, step, rank, attempt)``: stored twice)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.token = token
        self.job_ids: list[str] = []
        self.codes: Counter[int] = Counter()
        self.refused = 0
        self.longest_stall = 0.0
        self.followed: dict[str, Counter[tuple[Any, ...]]] = {}
        self._after: dict[str, int] = {}
        self.stop = threading.Event()

    @property
    def followed_points(self) -> int:
        return sum(sum(c.values()) for c in self.followed.values())

    @property
    def followed_duplicates(self) -> int:
        return sum(n - 1 for c in self.followed.values() for n in c.values() if n > 1)

    def _follow(self, job_id: str, body: dict[str, Any]) -> None:
        seen = self.followed.setdefault(job_id, Counter())
        for p in body["items"]:
            seen[(p["name"], p["epoch"], p["step"], p["rank"], p["attempt"])] += 1
        if body["items"] and body.get("next_after") is not None:
            self._after[job_id] = body["next_after"]

    def run(self) -> None:
        last_ok = time.monotonic()
        with httpx.Client(base_url=self.url, headers=auth(self.token), timeout=30) as http:
            while not self.stop.wait(0.1):
                requests: list[tuple[str, dict[str, Any], str | None]] = [
                    ("/v1/cluster", {}, None),
                    ("/v1/jobs", {}, None),
                ]
                for job_id in list(self.job_ids):
                    requests.append((f"/v1/jobs/{job_id}", {}, None))
                    params = {
                        "after": self._after.get(job_id, 0),
                        "limit": 1000,
                        "include_superseded": "true",
                    }
                    requests.append((f"/v1/jobs/{job_id}/metrics", params, job_id))
                for path, params, following in requests:
                    try:
                        r = http.get(path, params=params)
                        code = r.status_code
                        if code == 200 and following is not None:
                            self._follow(following, r.json())
                    except httpx.TransportError:
                        self.refused += 1
                        code = 0
                    self.codes[code] += 1
                    now = time.monotonic()
                    if code == 200:
                        last_ok = now
                    self.longest_stall = max(self.longest_stall, now - last_ok)


def chaos(
    api: ApiProcess,
    pg: Any,
    every: float,
    api_down: float,
    db_down: float,
    stop: threading.Event,
    kinds: tuple[str, ...] = ("api", "db"),
) -> list[str]:
    """Until ``stop``: every ``every`` seconds, the next fault of ``kinds`` in turn: SIGKILL
    the API and start it again ``api_down`` s later ("api"), or stop PostgreSQL for
    ``db_down`` s ("db"). Each fault is undone before this returns."""
    done: list[str] = []
    turn = 0
    while not stop.wait(every):
        if kinds[turn % len(kinds)] == "api":
            api.kill()
            stop.wait(api_down)
            api.start()
            done.append(f"API SIGKILL, {api_down:g} s down")
        else:
            pg.stop()
            stop.wait(db_down)
            pg.start()
            done.append(f"PostgreSQL stopped {db_down:g} s")
        turn += 1
    return done


def wait_final(url: str, token: str, job_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, headers=auth(token), timeout=30) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError, ValueError):
                r = http.get(f"/v1/jobs/{job_id}")
                if r.status_code == 200 and r.json()["status"] in FINAL:
                    return dict(r.json())
            time.sleep(0.3)
    return {"id": job_id, "status": "lost (not final in time)"}


def metric_check(url: str, token: str, job_id: str, runs: Path) -> tuple[int, int]:
    """(points lost, points duplicated) of one job."""
    written: Counter[tuple[Any, ...]] = Counter()
    for run_dir in runs.glob(f"{job_id}-*"):
        for line in (run_dir / "events.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event.get("type") == "metric":
                written[(event["name"], event["epoch"], event["step"], event.get("rank", 0))] += 1
    stored: Counter[tuple[Any, ...]] = Counter()
    after = None
    with httpx.Client(base_url=url, headers=auth(token), timeout=30) as http:
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if after is not None:
                params["after"] = after
            body = http.get(f"/v1/jobs/{job_id}/metrics", params=params).json()
            for p in body["items"]:
                stored[(p["name"], p["epoch"], p["step"], p["rank"])] += 1
            if not body["items"] or body.get("next_after") in (None, after):
                break
            after = body["next_after"]
    lost = sum((written - stored).values())
    duplicated = sum(n - 1 for n in stored.values() if n > 1)
    return lost, duplicated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--every", type=float, default=12.0, help="seconds between faults")
    parser.add_argument("--api-down", type=float, default=10.0, help="seconds the API stays down")
    parser.add_argument("--db-down", type=float, default=10.0, help="seconds PostgreSQL stays down")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-control-plane-"))
    pg = start_private_postgres()
    api = ApiProcess(tmp / "data", pg.create_database("torchyard"), settings=SETTINGS).start().wait_ready()
    admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60)
    user = user_client(admin, api.url)
    token = user.headers["Authorization"].split()[1]
    train, val = upload_digits(user, tmp / "digits", per_class=10, size=16)
    agent = start_agent(api.url, worker_token(admin), "n1", tmp / "n1", slots=1)
    time.sleep(5)
    poller = Poller(api.url, token)
    threading.Thread(target=poller.run, daemon=True).start()
    stop = threading.Event()
    faults: list[str] = []
    chaos_thread = threading.Thread(
        target=lambda: faults.extend(chaos(api, pg, args.every, args.api_down, args.db_down, stop)),
        daemon=True,
    )
    spec = job_spec(
        train,
        val,
        parameters={
            "epochs": args.epochs,
            "patience": args.epochs,
            "batch_size": 16,
            "image_size": 16,
            "augmentation": "none",
            "print_frequency": 1,
        },
        resources={"node_count": 1, "process_count_per_node": 1},
    )
    results = []
    started = time.monotonic()
    chaos_thread.start()
    try:
        for _ in range(args.jobs):
            while True:  # submit, retrying through the faults as a client would
                with contextlib.suppress(httpx.TransportError):
                    r = httpx.post(f"{api.url}/v1/jobs", json=spec, headers=auth(token), timeout=30)
                    if r.status_code == 201:
                        break
                time.sleep(0.5)
            job_id = r.json()["id"]
            poller.job_ids.append(job_id)
            results.append(wait_final(api.url, token, job_id, timeout=1800))
            print(f"job {job_id}: {results[-1]['status']} ({time.monotonic() - started:.0f} s)", flush=True)
        stop.set()
        chaos_thread.join(120)
        api.wait_ready(timeout=120)
        poller.stop.set()
        checks = [metric_check(api.url, token, j["id"], tmp / "n1" / "runs") for j in results]
    finally:
        stop.set()
        agent.stop(timeout=60)
        api.terminate()
        pg.close()
    took = time.monotonic() - started
    succeeded = sum(1 for j in results if j["status"] == "succeeded")
    five = sum(n for code, n in poller.codes.items() if code >= 500)
    print(f"machine: {platform.machine()}, {platform.system()}; {args.jobs} jobs, {took:.0f} s")
    print(f"faults: {len(faults)} ({', '.join(Counter(faults).keys())})")
    print(f"jobs succeeded: {succeeded} / {len(results)}; failed or lost: {len(results) - succeeded}")
    for j in results:
        if j["status"] != "succeeded":
            print(f"  {j['id']}: {j['status']} {j.get('failure')}")
    print(f"answers: {dict(sorted(poller.codes.items()))} (0 = connection refused while the API was down)")
    print(f"5xx: {five}, of which 500: {poller.codes[500]}")
    print(f"longest client-visible stall: {poller.longest_stall:.1f} s")
    print(f"metric points lost: {sum(c[0] for c in checks)}, duplicated: {sum(c[1] for c in checks)}")
    print(f"points the follower received: {poller.followed_points}, twice: {poller.followed_duplicates}")
    return 0 if succeeded == len(results) and poller.codes[500] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
