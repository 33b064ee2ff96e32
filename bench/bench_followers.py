"""Many followers of one running job against one API process (bench/RESULTS.md).

Starts ``torchyard serve`` (one uvicorn process, SQLite in a temporary data dir unless
``--database-url`` names a PostgreSQL), uploads two tiny datasets, submits a job and
plays its worker over the real worker routes: the job runs, metric points and log
lines are reported at a steady rate, then the job is cancelled. Meanwhile N followers
(asyncio + httpx in this process) read it live: most of them
``GET /v1/jobs/{id}/events`` (server-sent events), the rest
``GET /v1/jobs/{id}/logs?follow=true``.

Every reported point and line carries the time it was sent, so each follower
measures the delay from the report to its arrival. Printed:

* time to first byte of each stream (connect → first event or log byte), all of them
  connecting at once, and for a few late joiners connecting one at a time mid-run;
* event delay p50/p99/max over every (follower, event) pair;
* completeness: every follower got every point and line, once, and its stream ended
  with the job;
* the API process's resident memory before the followers, with them connected, and
  at the end, and its CPU time.

Usage::

    python bench/bench_followers.py                        # 200 followers, 10 s of reports
    python bench/bench_followers.py --followers 500 --seconds 20 --rate 50
    python bench/bench_followers.py --database-url postgresql://postgres@127.0.0.1:5432/postgres

Measured on a 2-core CPU-only machine (load average below 1; the bench's 200 clients
run on the same two cores as the API), 150 SSE + 50 ``logs -f`` followers, 20 points
and 20 log lines per second for 10 s:

=============================================  ==================  ==================
what                                           SQLite              PostgreSQL
=============================================  ==================  ==================
complete streams (every point once, ended)     200/200             200/200
first byte, 200 connecting at once  p50 / p99  1.6 s / 3.5 s       2.4 s / 4.2 s
first event, a late joiner while 200 stream    20 ms (max 52 ms)   22 ms (max 45 ms)
event delay (SSE)              p50 / p99 / max  39 / 66 / 719 ms    47 / 75 / 382 ms
log delay (logs -f)            p50 / p99 / max  22 / 37 / 702 ms    31 / 52 / 357 ms
API RSS: before / 200 connected / after        967 / 984 / 989 MiB 976 / 987 / 989 MiB
API CPU time for the whole run                 8.8 s               8.5 s
=============================================  ==================  ==================

The followers share one poll of the database per job (plus an immediate wake-up when
a report is written through the same process), so the database sees the same queries
with 1 or 200 followers, and each follower costs about 0.1 MiB. The burst figure is
dominated by per-request work that every route pays (authentication and the job
lookup, each a short database read in the threadpool): 200 requests of any route at
once take about as long.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

LEASE = "X-Torchyard-Lease"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Follower:
    kind: str  # "events" or "logs"
    ttfb: float | None = None
    delays: list[float] = field(default_factory=list)
    metric_seqs: list[int] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    final: str | None = None
    error: str | None = None


async def follow_events(client: httpx.AsyncClient, job_id: str, f: Follower) -> None:
    start = time.monotonic()
    try:
        async with client.stream("GET", f"/v1/jobs/{job_id}/events", params={"logs": "false"}) as r:
            r.raise_for_status()
            kind, data = "", ""
            async for line in r.aiter_lines():
                if f.ttfb is None and line and not line.startswith(("retry", ":")):
                    f.ttfb = time.monotonic() - start
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
                elif line == "" and data:
                    payload = json.loads(data)
                    if kind == "metric":
                        sent = datetime.fromisoformat(payload["time"]).timestamp()
                        f.delays.append(time.time() - sent)
                        f.metric_seqs.append(payload["seq"])
                    elif kind == "status" and payload.get("final"):
                        f.final = payload["status"]
                    kind, data = "", ""
    except Exception as exc:
        f.error = f"{type(exc).__name__}: {exc}"


async def follow_logs(client: httpx.AsyncClient, job_id: str, f: Follower) -> None:
    start = time.monotonic()
    buffer = ""
    try:
        async with client.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}) as r:
            r.raise_for_status()
            async for text in r.aiter_text():
                if f.ttfb is None:
                    f.ttfb = time.monotonic() - start
                buffer += text
                *lines, buffer = buffer.split("\n")
                now = time.time()
                for line in lines:
                    f.log_lines.append(line)
                    f.delays.append(now - float(line.split("t=")[1]))
        f.final = "ended"
    except Exception as exc:
        f.error = f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def scratch_database(server_url: str | None) -> Iterator[str | None]:
    """A fresh database of its own on the PostgreSQL server of ``server_url``, dropped after."""
    if not server_url:
        yield None
        return
    import sqlalchemy as sa

    url = (
        server_url
        if "+psycopg" in server_url
        else server_url.replace("postgresql://", "postgresql+psycopg://", 1)
    )
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"torchyard_bench_{os.getpid()}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


class Service:
    def __init__(self, database_url: str | None) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-followers-")
        self.data_dir = Path(self.tmp.name) / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        env["TORCHYARD_DATA_DIR"] = str(self.data_dir)
        if database_url:
            env["TORCHYARD_DATABASE_URL"] = database_url
        self.log = open(Path(self.tmp.name) / "serve.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchyard.cli", "serve", "--port", str(self.port)],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    "torchyard serve did not start; see " + str(Path(self.tmp.name) / "serve.log")
                )
            time.sleep(0.2)
        self.admin_token = (self.data_dir / "admin.token").read_text().strip()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        self.log.close()
        self.tmp.cleanup()


class ScriptedWorker:
    """Plays a worker agent over the worker routes: claim, run, report, stop."""

    def __init__(self, service: Service, admin: httpx.Client) -> None:
        token = admin.post("/v1/tokens", json={"name": "bench-worker", "role": "worker"}).json()["token"]
        self.http = httpx.Client(
            base_url=service.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        r = self.http.post(
            "/v1/worker/nodes", json={"name": "bench-node", "address": "127.0.0.1", "units": 1}
        )
        r.raise_for_status()
        self.lease: str | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(1.0):
            leases = [self.lease] if self.lease else []
            with contextlib.suppress(httpx.HTTPError):
                self.http.post("/v1/worker/nodes/bench-node/heartbeat", json={"leases": leases})

    def run(self, job_id: str, seconds: float, rate: float) -> tuple[int, int]:
        r = self.http.post("/v1/worker/nodes/bench-node/claim", params={"wait": 10})
        r.raise_for_status()
        placement = r.json()
        self.lease = placement["lease_token"]
        headers = {LEASE: self.lease}
        self.http.post(
            "/v1/worker/placements/status", json={"state": "running"}, headers=headers
        ).raise_for_status()
        points = lines = offset = 0
        interval = 1.0 / rate
        deadline = time.monotonic() + seconds
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            now = datetime.now(UTC)
            line = f"step {points} t={now.timestamp():.6f}\n"
            batch = {
                "metrics": [{"name": "train.loss", "value": 1.0 / (points + 1), "epoch": 1, "step": points,
                             "rank": 0, "time": now.isoformat()}],
                "logs": [{"stream": "rank-0", "offset": offset, "data": line}],
            }  # fmt: skip
            self.http.post(
                f"/v1/worker/jobs/{job_id}/reports", json=batch, headers=headers
            ).raise_for_status()
            offset += len(line.encode())
            points += 1
            lines += 1
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        return points, lines

    def finish(self, job_id: str, admin: httpx.Client) -> None:
        admin.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
        headers = {LEASE: self.lease or ""}
        self.http.post(
            "/v1/worker/placements/status", json={"state": "cancelled"}, headers=headers
        ).raise_for_status()
        self._stop.set()


def upload_tiny_datasets(admin: httpx.Client, root: Path) -> tuple[str, str]:
    from torchyard.client import pack_directory
    from torchyard.sample_data import write_digits

    ids = []
    for folder in write_digits(root, per_class=3, size=16):
        archive = root / f"{folder.name}.tar.gz"
        with open(archive, "wb") as out:
            pack_directory(folder, out)
        with open(archive, "rb") as fh:
            r = admin.post("/v1/datasets", data={"name": folder.name}, files={"file": (archive.name, fh)})
        r.raise_for_status()
        ids.append(r.json()["id"])
    return ids[0], ids[1]


async def main_async(args: argparse.Namespace) -> int:
    with scratch_database(args.database_url) as database_url:
        return await run_bench(args, database_url)


async def run_bench(args: argparse.Namespace, database_url: str | None) -> int:
    service = Service(database_url)
    admin = httpx.Client(
        base_url=service.url, headers={"Authorization": f"Bearer {service.admin_token}"}, timeout=60
    )
    try:
        worker = ScriptedWorker(service, admin)
        train, val = upload_tiny_datasets(admin, Path(service.tmp.name) / "digits")
        job = admin.post(
            "/v1/jobs",
            json={"model": {"architecture": "resnet18"}, "train_dataset": train, "validation_dataset": val},
        )
        job.raise_for_status()
        job_id = job.json()["id"]
        rss_before = rss_mib(service.process.pid)
        cpu_before = cpu_seconds(service.process.pid)

        n_logs = int(args.followers * args.log_share)
        followers = [Follower("logs") for _ in range(n_logs)] + [
            Follower("events") for _ in range(args.followers - n_logs)
        ]
        limits = httpx.Limits(max_connections=args.followers + 10, max_keepalive_connections=0)
        timeout = httpx.Timeout(30.0, read=None)
        headers = {"Authorization": f"Bearer {service.admin_token}"}
        async with httpx.AsyncClient(
            base_url=service.url, headers=headers, limits=limits, timeout=timeout
        ) as client:
            tasks = [
                asyncio.create_task(
                    follow_logs(client, job_id, f) if f.kind == "logs" else follow_events(client, job_id, f)
                )
                for f in followers
            ]
            # Let every follower connect before the job starts reporting.
            t0 = time.monotonic()
            while sum(f.ttfb is not None or f.kind == "logs" for f in followers) < len(followers):
                if time.monotonic() - t0 > 60:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
            rss_connected = rss_mib(service.process.pid)
            stop_polling = asyncio.Event()
            poll_latencies: list[float] = []
            poll_errors: list[str] = []
            pollers = [
                asyncio.create_task(
                    poll(client, job_id, stop_polling, args.poll_interval, poll_latencies, poll_errors)
                )
                for _ in range(args.pollers)
            ]
            run = asyncio.create_task(asyncio.to_thread(worker.run, job_id, args.seconds, args.rate))
            # Late joiners, one at a time, while all the others stream and the job reports.
            await asyncio.sleep(min(2.0, args.seconds / 4))
            late: list[float] = []
            for _ in range(args.late):
                start = time.monotonic()
                async with client.stream("GET", f"/v1/jobs/{job_id}/events", params={"logs": "false"}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("event: "):
                            late.append(time.monotonic() - start)
                            break
                await asyncio.sleep(0.1)
            points, lines = await run
            stop_polling.set()
            await asyncio.gather(*pollers)
            rss_busy = rss_mib(service.process.pid)
            await asyncio.to_thread(worker.finish, job_id, admin)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        rss_after = rss_mib(service.process.pid)
        cpu_used = cpu_seconds(service.process.pid) - cpu_before

        errors = [f.error for f in followers if f.error]
        events = [f for f in followers if f.kind == "events"]
        logs = [f for f in followers if f.kind == "logs"]
        complete_events = sum(
            len(f.metric_seqs) == points and len(set(f.metric_seqs)) == points and f.final == "cancelled"
            for f in events
        )
        complete_logs = sum(len(f.log_lines) == lines and f.final == "ended" for f in logs)
        ttfb = [f.ttfb for f in followers if f.ttfb is not None]
        ev_delays = [d for f in events for d in f.delays]
        log_delays = [d for f in logs for d in f.delays]
        db = "PostgreSQL" if args.database_url else "SQLite"
        print(f"torchyard followers bench: 1 API process ({db}), {len(events)} event followers + "
              f"{len(logs)} `logs -f` followers of one job, {points} metric points and {lines} log lines "
              f"reported over {args.seconds:.0f} s ({args.rate:g}/s each)")  # fmt: skip
        print(f"  complete streams         events {complete_events}/{len(events)}, logs {complete_logs}/{len(logs)}"
              f"; errors: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))  # fmt: skip
        print(f"  time to first byte       p50 {pct(ttfb, 0.5) * 1000:.0f} ms, p99 {pct(ttfb, 0.99) * 1000:.0f} ms, "
              f"max {max(ttfb, default=float('nan')) * 1000:.0f} ms")  # fmt: skip
        print(f"  late joiner first event  p50 {pct(late, 0.5) * 1000:.0f} ms, max {max(late, default=float('nan')) * 1000:.0f} ms "
              f"({len(late)} followers connecting one at a time while {len(followers)} stream)")  # fmt: skip
        for label, delays in (("event delay (SSE)", ev_delays), ("log delay (follow)", log_delays)):
            if delays:
                print(f"  {label:<24} p50 {pct(delays, 0.5) * 1000:.0f} ms, p99 {pct(delays, 0.99) * 1000:.0f} ms, "
                      f"max {max(delays) * 1000:.0f} ms, mean {statistics.fmean(delays) * 1000:.0f} ms "
                      f"({len(delays)} deliveries)")  # fmt: skip
        print(f"  API RSS                  {rss_before:.0f} MiB before, {rss_connected:.0f} MiB with "
              f"{len(followers)} followers connected, {rss_busy:.0f} MiB at the end of the reports, "
              f"{rss_after:.0f} MiB after")  # fmt: skip
        print(f"  API CPU time             {cpu_used:.1f} s over the run")
        if args.pollers:
            print(f"  pollers                  {args.pollers} clients every {args.poll_interval:g} s, "
                  f"{len(poll_latencies)} requests "
                  f"(GET /v1/jobs/ID and /metrics?after=), p50 {pct(poll_latencies, 0.5) * 1000:.0f} ms, "
                  f"p99 {pct(poll_latencies, 0.99) * 1000:.0f} ms, max {max(poll_latencies, default=0) * 1000:.0f} ms"
                  f", errors: {len(poll_errors)}" + (f" (first: {poll_errors[0]})" if poll_errors else ""))  # fmt: skip
        errors += poll_errors
        return 0 if not errors and complete_events == len(events) and complete_logs == len(logs) else 1
    finally:
        admin.close()
        service.stop()


async def poll(
    client: httpx.AsyncClient,
    job_id: str,
    stop: asyncio.Event,
    interval: float,
    latencies: list[float],
    errors: list[str],
) -> None:
    """A polling client: the job's status, then its new metric points, every ``interval`` s."""
    after = 0
    await asyncio.sleep(random.uniform(0, interval))  # clients are not in lockstep
    while not stop.is_set():
        began = time.monotonic()
        for path, params in ((f"/v1/jobs/{job_id}", {}), (f"/v1/jobs/{job_id}/metrics", {"after": after})):
            start = time.monotonic()
            try:
                r = await client.get(path, params=params)
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            latencies.append(time.monotonic() - start)
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:100]}")
            elif "next_after" in r.json():
                after = r.json()["next_after"] or after
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--followers", type=int, default=200)
    parser.add_argument(
        "--log-share", type=float, default=0.25, help="share of followers on logs?follow=true"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the job reports")
    parser.add_argument(
        "--rate", type=float, default=20.0, help="reports per second (a point and a line each)"
    )
    parser.add_argument("--late", type=int, default=10, help="followers joining one by one mid-run")
    parser.add_argument(
        "--pollers", type=int, default=0, help="clients polling the job's status and metrics while it reports"
    )
    parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds between a poller's rounds")
    parser.add_argument(
        "--database-url", default=None, help="a PostgreSQL server (the bench uses a scratch database on it)"
    )
    args = parser.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
