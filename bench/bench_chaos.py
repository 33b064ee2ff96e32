"""Chaos run (SPEC §8): N short real jobs while agents are SIGKILLed and SIGTERMed at random.

A real API (uvicorn on loopback, SQLite unless ``--database-url`` names a PostgreSQL) and
``--agents`` real ``torchyard worker`` agents (1 CPU slot each). ``--jobs`` short training
jobs (resnet18 at 16 px on the digits, 1 process each, ``--epochs`` epochs) are submitted at
once. For ``--chaos-seconds`` the script then picks a random running agent every few seconds
and sends it SIGKILL (a crash: a restart of the job, counted) or SIGTERM (a preemption:
the job checkpoints and goes back to the queue, not counted), and starts the agent again
(same name and work directory, as a rebooted node) a few seconds later. Afterwards every
agent runs again and the script waits for every job to end.

Reported: jobs succeeded / failed / lost (not ended by ``--timeout``), the kills and
terminations sent, restarts and preemptions the jobs went through, and metric points of
the default history that appear more than once per ``(name, epoch, step, rank)``
(goal: every job succeeds, none lost, zero duplicated).

Usage::

    python bench/bench_chaos.py --jobs 6 --agents 3 --chaos-seconds 120 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_queue_latency import api_server, upload_digits

from service.config import Settings

FINAL = {"succeeded", "failed", "cancelled"}


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
                 "--cpu", "--slots", "1", "--work-dir", str(self.work_dir), "--grace-period", "10"],
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


def duplicated_points(client: httpx.Client, job_id: str) -> tuple[int, int]:
    """(points in the default history, points beyond the first per (name, epoch, step, rank))."""
    points = _all_pages(client, f"/v1/jobs/{job_id}/metrics", {})
    seen = collections.Counter((p["name"], p["epoch"], p["step"], p["rank"]) for p in points)
    return len(points), sum(n - 1 for n in seen.values() if n > 1)


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
        statuses = [admin.get(f"/v1/jobs/{j}").json()["status"] for j in job_ids]
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
        jobs = {j: admin.get(f"/v1/jobs/{j}").json() for j in job_ids}
        if all(job["status"] in FINAL for job in jobs.values()):
            break
        time.sleep(1.0)
    took = time.monotonic() - submitted

    outcome = collections.Counter[str]()
    restarts = preemptions = points = duplicated = 0
    for job_id, job in jobs.items():
        outcome[job["status"] if job["status"] in FINAL else "lost"] += 1
        restarts += job["restarts"]
        preemptions += sum(1 for h in job["history"] if h["status"] == "queued" and "preempt" in h["message"])
        n, d = duplicated_points(admin, job_id)
        points += n
        duplicated += d
        if job["status"] != "succeeded":
            print(f"job {job_id}: {job['status']} {job.get('failure')}", flush=True)
    totals = {"restarts": restarts, "preemptions": preemptions, "points": points, "duplicated": duplicated}
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
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temporary directory")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="ty-chaos-") as tmp_name:
        tmp = Path(tmp_name)
        settings = Settings(
            data_dir=tmp / "data",
            database_url=args.database_url,
            lease_timeout_s=args.lease_timeout,
            heartbeat_interval_s=min(1.0, args.lease_timeout / 5),
            reaper_interval_s=0.2,
        )
        with api_server(settings) as url:
            admin_token = settings.admin_token_path.read_text().strip()
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
                print(f"database: {settings.sqlalchemy_url.split('@')[-1]}  cpus: {os.cpu_count()}  "
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
                sent = chaos(args, rng, agents, admin, job_ids)
                outcome, totals, took = settle(args, agents, admin, job_ids, submitted)
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
    print(f"metric points in the default history {totals['points']}  duplicated {totals['duplicated']}")
    print(f"all jobs ended {took:.0f} s after submission")
    return 0 if outcome["succeeded"] == args.jobs and totals["duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
