"""Chaos run (docs/restarts.md): N short real jobs while agents are SIGKILLed and SIGTERMed at random.

A real API (uvicorn on loopback, SQLite unless ``--database-url`` names a PostgreSQL) and
``--agents`` real ``torchyard worker`` agents (1 CPU slot each). ``--jobs`` short training
jobs (resnet18 at 16 px on the digits, 1 process each, ``--epochs`` epochs) are submitted at
once. For ``--chaos-seconds`` the script then picks a random running agent every few seconds
and sends it SIGKILL (a crash: a restart of the job, counted) or SIGTERM (a preemption:
the job checkpoints and goes back to the queue, not counted), and starts the agent again
(same name and work directory, as a rebooted node) a few seconds later. Afterwards every
agent runs again and the script waits for every job to end.

Control-plane faults on top (docs/restarts.md, last bullet): with ``--kill-api`` the API is a
``torchyard serve`` process, SIGKILLed and started again (``--api-down`` s later) during
the chaos; with ``--stop-db`` it runs on a private PostgreSQL server of the run's own
(initdb into a temporary folder), stopped and started again (``--db-down`` s); the two
alternate every ``--fault-every`` s. A user then polls the jobs and follows their metric
points (``include_superseded=true``, by cursor) all along, and the script reports its
answers by status (0: connection refused, 500 apart from 503), the longest time it went
without a 200, and the points it received twice.

Reported: jobs succeeded / failed / lost (not ended by ``--timeout``), the kills and
terminations sent, restarts and preemptions the jobs went through, and metric points of
the default history that appear more than once per ``(name, epoch, step, rank)`` or that
the ranks wrote (their run directories' ``events.jsonl``) but the history lacks
(goal: every job succeeds, none lost, zero duplicated or missing, zero 500s).

Usage (from the repository root)::

    python bench/bench_chaos.py --jobs 6 --agents 3 --chaos-seconds 120 --seed 1
    python bench/bench_chaos.py --kill-api --stop-db --jobs 3 --agents 2 --chaos-seconds 90
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_queue_latency import api_server, upload_digits

from service.config import Settings

FINAL = {"succeeded", "failed", "cancelled"}
ROOT = Path(__file__).resolve().parents[1]


class Agent:
    """A ``torchyard worker`` subprocess that can be killed and started again."""

    def __init__(self, url: str, token: str, name: str, tmp: Path) -> None:
        self.url, self.token, self.name = url, token, name
        self.work_dir = tmp / name
        self.log_path = tmp / f"agent-{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.down_until = 0.0

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "torchyard.cli", "worker", "--api", self.url, "--name", self.name,
                 "--cpu", "--slots", "1", "--work-dir", str(self.work_dir), "--grace-period", "10",
                 "--keep-runs", "1000"],  # every attempt's events.jsonl is read at the end
                env={**os.environ, "TORCHYARD_TOKEN": self.token, "TORCHYARD_PREEMPT_GRACE_S": "15"},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.alive():
            self.process.send_signal(sig)

    def reap(self, timeout: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def wait_ready(admin: httpx.Client, names: list[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = {n["name"] for n in admin.get("/v1/cluster").json()["nodes"] if n["status"] == "ready"}
        if set(names) <= ready:
            return
        time.sleep(0.2)
    raise SystemExit(f"agents {names} did not all register within {timeout:g} s")


def _all_pages(client: httpx.Client, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    after = 0
    while True:
        r = client.get(path, params={**params, "after": after, "limit": 10000})
        r.raise_for_status()
        page = r.json()
        items.extend(page["items"])
        if not page["items"]:
            return items
        after = page["next_after"]


def duplicated_points(client: httpx.Client, job_id: str, agents: list[Agent]) -> tuple[int, int, int, int]:
    """(points in the default history, points beyond the first per (name, epoch, step, rank),
    points the ranks wrote (distinct keys, every attempt's run directory on every agent),
    those of them missing from the default history)."""
    points = _all_pages(client, f"/v1/jobs/{job_id}/metrics", {})
    seen = collections.Counter((p["name"], p["epoch"], p["step"], p["rank"]) for p in points)
    written: set[tuple[Any, ...]] = set()
    for agent in agents:
        for events in agent.work_dir.glob(f"runs/{job_id}-*/events.jsonl"):
            for line in events.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("type") == "metric":
                        written.add((event["name"], event["epoch"], event["step"], event.get("rank", 0)))
    missing = len(written - set(seen))
    return len(points), sum(n - 1 for n in seen.values() if n > 1), len(written), missing


def get_json(client: httpx.Client, path: str, timeout: float = 300) -> dict[str, Any]:
    """GET, retried while the API is down or answers 503 (a control-plane fault)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            r = client.get(path)
            if r.status_code < 500 or time.monotonic() > deadline:
                r.raise_for_status()
                body: dict[str, Any] = r.json()
                return body
        if time.monotonic() > deadline:
            raise SystemExit(f"GET {path}: the API did not answer within {timeout:g} s")
        time.sleep(0.5)


def job_status(client: httpx.Client, job_id: str) -> str | None:
    """The job's status, or None while the API cannot tell (down, 503)."""
    with contextlib.suppress(httpx.TransportError, ValueError):
        r = client.get(f"/v1/jobs/{job_id}")
        if r.status_code == 200:
            status: str = r.json()["status"]
            return status
    return None


@dataclass
class ControlPlane:
    """The API and its database; with ``api`` (a ``torchyard serve`` process), faults can be
    caused: ``kinds`` names them ("api": SIGKILL and restart, "db": stop and start ``pg``)."""

    url: str
    admin_token: str
    database: str
    api: Any = None
    pg: Any = None
    kinds: tuple[str, ...] = ()


@contextlib.contextmanager
def control_plane(args: argparse.Namespace, tmp: Path) -> Iterator[ControlPlane]:
    """In process (uvicorn on loopback) with no control-plane fault asked for; otherwise
    ``torchyard serve`` as a subprocess, on a private PostgreSQL server with ``--stop-db``."""
    settings = Settings(
        data_dir=tmp / "data",
        database_url=args.database_url,
        lease_timeout_s=args.lease_timeout,
        heartbeat_interval_s=min(1.0, args.lease_timeout / 5),
        reaper_interval_s=0.2,
    )
    kinds = tuple(k for k, on in (("api", args.kill_api), ("db", args.stop_db)) if on)
    if not kinds:
        with api_server(settings) as url:
            yield ControlPlane(
                url, settings.admin_token_path.read_text().strip(), _where(settings.sqlalchemy_url)
            )
        return
    # The test helpers (serve as a subprocess, a private PostgreSQL server) are reused.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.support.api_process import ApiProcess
    from tests.support.private_pg import start_private_postgres

    pg = start_private_postgres() if args.stop_db else None
    try:
        url = pg.create_database("torchyard") if pg is not None else args.database_url
        env = {
            "TORCHYARD_LEASE_TIMEOUT_S": str(settings.lease_timeout_s),
            "TORCHYARD_HEARTBEAT_INTERVAL_S": str(settings.heartbeat_interval_s),
            "TORCHYARD_REAPER_INTERVAL_S": str(settings.reaper_interval_s),
            "TORCHYARD_RETRY_AFTER_S": "1",
        }
        api = ApiProcess(settings.data_dir, url, settings=env, name="chaos-api")
        api.start().wait_ready()
        try:
            database = "private PostgreSQL" if pg is not None else _where(settings.sqlalchemy_url)
            yield ControlPlane(api.url, api.admin_token, database, api, pg, kinds)
        finally:
            api.terminate()
    finally:
        if pg is not None:
            pg.close()


def _where(url: str) -> str:
    return url.split("@")[-1]


class ControlPlaneFaults:
    """While the agents' chaos runs: the control-plane faults of ``plane.kinds`` (in turn,
    every ``--fault-every`` s) and a user polling the jobs and following their metric points."""

    def __init__(self, plane: ControlPlane, args: argparse.Namespace, job_ids: list[str], token: str) -> None:
        from bench_control_plane import Poller, chaos

        self.plane = plane
        self.poller = Poller(plane.url, token)
        self.poller.job_ids.extend(job_ids)
        self.stop = threading.Event()
        self.done: list[str] = []
        self.threads = [
            threading.Thread(target=self.poller.run, daemon=True),
            threading.Thread(
                target=lambda: self.done.extend(
                    chaos(
                        plane.api,
                        plane.pg,
                        args.fault_every,
                        args.api_down,
                        args.db_down,
                        self.stop,
                        plane.kinds,
                    )
                ),
                daemon=True,
            ),
        ]
        for thread in self.threads:
            thread.start()

    def end(self) -> None:
        """The last fault undone, the API ready again (the poller goes on until ``report``)."""
        self.stop.set()
        self.threads[1].join(300)
        self.plane.api.wait_ready(timeout=300)

    def report(self) -> bool:
        """Print the figures; whether there was no 500 and no point received twice."""
        self.poller.stop.set()
        self.threads[0].join(60)
        codes = self.poller.codes
        five = sum(n for code, n in codes.items() if code >= 500)
        print(
            f"control-plane faults: {len(self.done)} ({', '.join(f'{n} x {k}' for k, n in collections.Counter(self.done).items())})"
        )
        print(
            f"client answers: {dict(sorted(codes.items()))} (0 = connection refused while the API was down)"
        )
        print(f"5xx: {five}  of which 500: {codes[500]}  503: {codes[503]}")
        print(f"longest client-visible stall (no 200 answer): {self.poller.longest_stall:.1f} s")
        print(f"metric points the follower received: {self.poller.followed_points}  "
              f"twice: {self.poller.followed_duplicates}")  # fmt: skip
        return codes[500] == 0 and self.poller.followed_duplicates == 0


def chaos(
    args: argparse.Namespace, rng: random.Random, agents: list[Agent], admin: httpx.Client, job_ids: list[str]
) -> collections.Counter[str]:
    """Signal random live agents for ``args.chaos_seconds`` (or until every job ended); restart them."""
    sent = collections.Counter[str]()
    started = time.monotonic()
    chaos_end = started + args.chaos_seconds
    next_signal = started + rng.expovariate(1 / args.interval)
    while time.monotonic() < chaos_end:
        now = time.monotonic()
        for agent in agents:
            if not agent.alive() and now >= agent.down_until:
                agent.reap(0)
                agent.start()
        if now >= next_signal:
            live = [a for a in agents if a.alive()]
            if live:
                victim = rng.choice(live)
                sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
                victim.signal(sig)
                victim.down_until = now + args.down
                sent[sig.name] += 1
                print(f"{now - started:7.1f} s  {sig.name} {victim.name}", flush=True)
            next_signal = now + rng.expovariate(1 / args.interval)
        statuses = [job_status(admin, j) for j in job_ids]
        if all(s in FINAL for s in statuses):
            break
        time.sleep(0.5)

    return sent


def settle(
    args: argparse.Namespace, agents: list[Agent], admin: httpx.Client, job_ids: list[str], submitted: float
) -> tuple[collections.Counter[str], dict[str, int], float]:
    """Run every agent again, wait for the jobs to end; their outcomes and totals."""
    # Chaos over: every agent runs again (a SIGTERMed one may still be checkpointing).
    for agent in agents:
        if agent.process is not None and agent.process.poll() is None and agent.down_until > time.monotonic():
            agent.reap(60)
        if not agent.alive():
            agent.start()
    deadline = time.monotonic() + args.timeout
    jobs: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        jobs = {j: get_json(admin, f"/v1/jobs/{j}") for j in job_ids}
        if all(job["status"] in FINAL for job in jobs.values()):
            break
        time.sleep(1.0)
    took = time.monotonic() - submitted

    outcome = collections.Counter[str]()
    restarts = preemptions = points = duplicated = written = missing = 0
    for job_id, job in jobs.items():
        outcome[job["status"] if job["status"] in FINAL else "lost"] += 1
        restarts += job["restarts"]
        preemptions += sum(1 for h in job["history"] if h["status"] == "queued" and "preempt" in h["message"])
        n, d, w, m = duplicated_points(admin, job_id, agents)
        points += n
        duplicated += d
        written += w
        missing += m
        if job["status"] != "succeeded":
            print(f"job {job_id}: {job['status']} {job.get('failure')}", flush=True)
    totals = {
        "restarts": restarts,
        "preemptions": preemptions,
        "points": points,
        "duplicated": duplicated,
        "written": written,
        "missing": missing,
    }
    return outcome, totals, took


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--chaos-seconds", type=float, default=120.0)
    parser.add_argument("--interval", type=float, default=8.0, help="mean seconds between two signals")
    parser.add_argument("--down", type=float, default=4.0, help="seconds an agent stays down")
    parser.add_argument("--lease-timeout", type=float, default=5.0, help="TORCHYARD_LEASE_TIMEOUT_S")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait for the jobs after chaos"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--database-url",
        default=None,
        help="default: SQLite in a temporary directory (ignored with --stop-db)",
    )
    parser.add_argument(
        "--kill-api", action="store_true", help="also SIGKILL the API and start it again during the chaos"
    )
    parser.add_argument(
        "--stop-db",
        action="store_true",
        help="also stop and start the database (a private PostgreSQL server) during the chaos",
    )
    parser.add_argument(
        "--fault-every", type=float, default=20.0, help="seconds between control-plane faults"
    )
    parser.add_argument("--api-down", type=float, default=8.0, help="seconds the API stays down")
    parser.add_argument("--db-down", type=float, default=8.0, help="seconds PostgreSQL stays down")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="ty-chaos-") as tmp_name:
        tmp = Path(tmp_name)
        with control_plane(args, tmp) as plane:
            url, admin_token = plane.url, plane.admin_token
            admin = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=120
            )
            r = admin.post("/v1/tokens", json={"name": "chaos-worker", "role": "worker"})
            r.raise_for_status()
            token = r.json()["token"]
            train, val = upload_digits(admin, tmp / "digits", per_class=10)
            agents = [Agent(url, token, f"chaos-{i}", tmp) for i in range(args.agents)]
            try:
                for agent in agents:
                    agent.start()
                wait_ready(admin, [a.name for a in agents])
                print(f"database: {plane.database}  cpus: {os.cpu_count()}  "
                      f"agents: {args.agents}  jobs: {args.jobs}  epochs: {args.epochs}  "
                      f"lease timeout: {args.lease_timeout:g} s  load: {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
                job_ids = []
                for n in range(args.jobs):
                    spec = {
                        "name": f"chaos-{n}",
                        "model": {"architecture": "resnet18"},
                        "train_dataset": train,
                        "validation_dataset": val,
                        "parameters": {"epochs": args.epochs, "batch_size": 16, "image_size": 16,
                                       "augmentation": "none", "print_frequency": 2, "random_seed": n},
                        "resources": {"node_count": 1, "process_count_per_node": 1, "max_restarts": 100},
                    }  # fmt: skip
                    r = admin.post("/v1/jobs", json=spec)
                    if r.status_code != 201:
                        raise SystemExit(f"POST /v1/jobs: {r.status_code} {r.text}")
                    job_ids.append(r.json()["id"])

                submitted = time.monotonic()
                faults = ControlPlaneFaults(plane, args, job_ids, admin_token) if plane.kinds else None
                sent = chaos(args, rng, agents, admin, job_ids)
                if faults is not None:
                    faults.end()
                outcome, totals, took = settle(args, agents, admin, job_ids, submitted)
                clients_ok = faults.report() if faults is not None else True
            finally:
                # Also when something above failed: no agent outlives the run.
                for agent in agents:
                    agent.signal(signal.SIGTERM)
                for agent in agents:
                    agent.reap(60)
            admin.close()
    print(
        f"\nsignals sent: SIGKILL {sent['SIGKILL']}, SIGTERM {sent['SIGTERM']} in {args.chaos_seconds:g} s of chaos"
    )
    print(f"jobs: {args.jobs}  succeeded {outcome['succeeded']}  failed {outcome['failed']}  "
          f"cancelled {outcome['cancelled']}  lost {outcome['lost']}")  # fmt: skip
    print(f"restarts (counted) {totals['restarts']}  preemptions {totals['preemptions']}")
    print(f"metric points in the default history {totals['points']}  duplicated {totals['duplicated']}  "
          f"written by the ranks {totals['written']}  missing from the history {totals['missing']}")  # fmt: skip
    print(f"all jobs ended {took:.0f} s after submission")
    ok = outcome["succeeded"] == args.jobs and totals["duplicated"] == totals["missing"] == 0
    return 0 if ok and clients_ok else 1


if __name__ == "__main__":
    sys.exit(main())
