"""The control plane with many nodes and a long queue, on PostgreSQL.

Simulates ``--nodes`` nodes over the real worker protocol (registration, a heartbeat every
``heartbeat_interval_s`` with the leases held, long-polling claims, status reports) from
one asyncio process, against ``torchyard serve`` (``--workers`` API processes) on a fresh
database of the local PostgreSQL server. The queue is blocked the way a busy cluster's is:
a job asking for every node waits first in line (one node runs a job that never ends), and
``--queued`` jobs wait behind it (written in bulk with SQL). Then:

- the simulated nodes heartbeat at the interval the API hands out (at registration and in
  every heartbeat answer), as the agents do: it grows with the node count unless set;
- an idle window: heartbeats only; the database's transactions and rows read per second;
- ``--submit`` submissions at priority 0 (behind the blocker), 4 at a time:
  ``POST /v1/jobs`` jobs/s and p50/p99, and the scheduling passes they caused (index scans
  of the queue's index, less the reapers' one look a second per process);
- ``--probes`` probe jobs one after the other, at a priority above the blocker, that fit a
  free node: submission → claimed by a simulated node;
- scheduling passes timed from outside (the same pass function, in a process of its own,
  on the live database);
- heartbeats answered / offered per second over the whole run, their p99, and the nodes
  declared lost.

Usage (from the repository root)::

    python -m bench.bench_scale --nodes 100 --queued 10000
    python -m bench.bench_scale --nodes 1000 --queued 100000 --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from service.config import Settings
from service.db.engine import Database
from tests.conftest import free_port, scratch_database
from tests.support.factories import auth, insert_dataset, job_spec
from tests.support.queue_fill import fill_queue
from worker.agent.agent import MAX_CLAIM_WAIT_S

# Five scheduling passes (after one not timed) on the database named by argv[1], their
# milliseconds on one line.
_TIME_PASSES = """
import sys, time
from service.config import Settings
from service.db.engine import Database
from service.services.scheduler import run_pass
db = Database(sys.argv[1])
settings = Settings(database_url=sys.argv[1])
run_pass(db, settings)  # connecting and compiling the statements: not timed
out = []
for _ in range(5):
    start = time.perf_counter()
    run_pass(db, settings)
    out.append((time.perf_counter() - start) * 1000)
print(" ".join(f"{ms:.1f}" for ms in out))
"""


_T0 = time.monotonic()


def _phase(text: str) -> None:
    """A progress line on stderr (the table goes to stdout at the end)."""
    print(f"[{time.monotonic() - _T0:7.1f} s] {text}", file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Conn:
    """One keep-alive HTTP/1.1 connection of a simulated node: the worker protocol's requests,
    JSON in and out, written on asyncio streams.

    The simulator shares the API's two cores, so what it spends per request is taken from the
    control plane it measures: httpx spent about a millisecond of CPU per request here, with
    1,000 nodes a third to a half of a core. A stale keep-alive connection (the server closes
    idle ones after 5 s) is opened again once, before any byte of the answer was read.
    """

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.auth = f"Authorization: Bearer {token}\r\n".encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def post(
        self, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """(status, the JSON answer or None); raises ConnectionError when the server is gone."""
        payload = json.dumps(body if body is not None else {}).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n".encode()
            + self.auth
            + extra
            + b"\r\n"
            + payload
        )
        for attempt in (0, 1):
            reused = self.writer is not None
            if self.writer is None or self.reader is None or self.reader.at_eof():
                self.close()
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                reused = False
            reader, writer = self.reader, self.writer
            assert reader is not None and writer is not None
            try:
                writer.write(request)
                line = await reader.readline()
                if not line:
                    raise ConnectionResetError("closed before the answer")
            except (ConnectionError, OSError):
                self.close()
                if attempt == 0 and reused:
                    continue  # a keep-alive connection the server had closed: nothing was read
                raise
            try:
                status, data, close = await _read_answer(line, reader)
            except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
                self.close()
                raise ConnectionError(f"the answer was cut: {exc}") from exc
            if close:
                self.close()
            return status, (json.loads(data) if data else None)
        raise AssertionError("unreachable")


async def _read_answer(status_line: bytes, reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, whether the server closes the connection) of an HTTP/1.1 answer."""
    status = int(status_line.split()[1])
    length, close = 0, False
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b""):
            break
        key, _, value = header.decode("latin-1").partition(":")
        key = key.strip().lower()
        if key == "content-length":
            length = int(value)
        elif key == "connection" and value.strip().lower() == "close":
            close = True
        elif key == "transfer-encoding":
            raise ConnectionError(f"unexpected transfer-encoding {value.strip()}")
    data = await reader.readexactly(length) if length else b""
    return status, data, close


class Sim:
    """The simulated nodes and what they measured."""

    def __init__(self, url: str, token: str, nodes: int) -> None:
        parsed = httpx.URL(url)
        host, port = parsed.host, parsed.port or 80
        self.names = [f"sim-{i:04d}" for i in range(nodes)]
        # Two connections per node, as an agent has: heartbeats, and claims with their reports.
        self.beat_conn = {n: Conn(host, port, token) for n in self.names}
        self.claim_conn = {n: Conn(host, port, token) for n in self.names}
        self.leases: dict[str, list[str]] = {n: [] for n in self.names}
        # The heartbeat interval and claim wait each node was told last (registration, heartbeat
        # answers), followed as the agent follows them.
        self.interval: dict[str, float] = {}
        self.claim_wait: dict[str, float] = {}
        self.beats: list[tuple[float, float]] = []  # (time answered, latency)
        self.beat_errors = 0
        self.claimed: dict[str, float] = {}  # job name -> time its claim returned
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def close(self) -> None:
        for conn in [*self.beat_conn.values(), *self.claim_conn.values()]:
            conn.close()

    async def register(self) -> None:
        """Register every node, 32 at a time; as an agent does, each node heartbeats and claims
        from the moment its own registration is answered."""
        sem = asyncio.Semaphore(32)

        async def one(name: str) -> None:
            async with sem:
                body = {"name": name, "address": "127.0.0.1", "units": 1, "accelerator": "cpu"}
                for attempt in range(5):  # as an agent does: again after a dropped connection
                    try:
                        code, answer = await self.beat_conn[name].post("/v1/worker/nodes", body)
                        assert code == 200, (code, answer)
                        self.interval[name] = float(answer["heartbeat_interval_s"])
                        self.claim_wait[name] = min(MAX_CLAIM_WAIT_S, float(answer["claim_poll_timeout_s"]))
                        self.tasks.append(asyncio.create_task(self.heartbeats(name)))
                        self.tasks.append(asyncio.create_task(self.claims(name)))
                        return
                    except ConnectionError:
                        if attempt == 4:
                            raise
                        await asyncio.sleep(1)

        await asyncio.gather(*(one(n) for n in self.names))

    async def heartbeats(self, name: str) -> None:
        # As the agent: the registration was a sign of life, the first heartbeat an interval later.
        await asyncio.sleep(self.interval[name])
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                code, answer = await self.beat_conn[name].post(
                    f"/v1/worker/nodes/{name}/heartbeat", {"leases": self.leases[name]}
                )
                if code == 200:
                    self.beats.append((time.monotonic(), time.monotonic() - start))
                    self.interval[name] = float(answer["heartbeat_interval_s"])
                    self.claim_wait[name] = min(MAX_CLAIM_WAIT_S, float(answer["claim_poll_timeout_s"]))
                else:
                    self.beat_errors += 1
            except ConnectionError:
                self.beat_errors += 1
            await asyncio.sleep(max(0.0, self.interval[name] - (time.monotonic() - start)))

    async def claims(self, name: str) -> None:
        while not self.stop.is_set():
            conn = self.claim_conn[name]
            try:
                code, placement = await conn.post(
                    f"/v1/worker/nodes/{name}/claim?wait={self.claim_wait[name]:g}"
                )
            except ConnectionError:
                await asyncio.sleep(1)
                continue
            if code != 200:
                continue
            self.claimed[placement["job_name"]] = time.monotonic()
            lease = {"X-Torchyard-Lease": placement["lease_token"]}
            await conn.post("/v1/worker/placements/status", {"state": "running"}, lease)
            if placement["job_name"] == "holder":
                self.leases[name].append(placement["lease_token"])  # runs until the end
                continue
            await conn.post("/v1/worker/placements/status", {"state": "failed", "exit_code": 1}, lease)


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by this process (the simulator), the API processes and
    PostgreSQL's (read from /proc; Linux only, else empty)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {"simulator": 0.0, "api": 0.0, "postgres": 0.0}
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        if int(entry.name) == os.getpid():
            used["simulator"] += seconds
        elif b"torchyard.cli\0serve" in cmdline:
            used["api"] += seconds
        elif stat.split(" (", 1)[1].startswith("postgres)"):
            used["postgres"] += seconds
    return used


def _db_counters(db: Database) -> tuple[int, int, int]:
    """(transactions, rows read, index scans of the queue's index) so far."""
    with db.engine.connect() as conn:
        xact, rows = conn.execute(
            sa.text(
                "SELECT xact_commit + xact_rollback, tup_returned + tup_fetched "
                "FROM pg_stat_database WHERE datname = current_database()"
            )
        ).one()
        scans = conn.execute(
            sa.text(
                "SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes WHERE indexrelname = 'ix_jobs_queue'"
            )
        ).scalar_one()
    return int(xact), int(rows), int(scans)


async def _wait_for(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return False


async def run(args: argparse.Namespace, url: str, db_url: str, data_dir: Path) -> dict[str, Any]:
    settings = Settings(data_dir=data_dir, database_url=db_url)
    admin = httpx.AsyncClient(
        base_url=url, headers=auth((data_dir / "admin.token").read_text().strip()), timeout=60
    )
    worker = (await admin.post("/v1/tokens", json={"name": "sim", "role": "worker"})).json()["token"]
    user_token = (await admin.post("/v1/tokens", json={"name": "bench", "role": "user"})).json()["token"]
    owner = (await admin.get("/v1/whoami", headers=auth(user_token))).json()["id"]
    dataset = insert_dataset(settings, owner)
    user = httpx.AsyncClient(
        base_url=url, headers=auth(user_token), timeout=120, limits=httpx.Limits(keepalive_expiry=2.0)
    )
    db = Database(db_url)
    sim = Sim(url, worker, args.nodes)

    started = time.monotonic()
    _phase(f"registering {args.nodes} nodes")
    await sim.register()
    registered_s = time.monotonic() - started
    _phase(f"registered in {registered_s:.1f} s")
    tasks = sim.tasks
    beats_from = time.monotonic()

    def spec(name: str, priority: int, nodes: int = 1) -> dict[str, Any]:
        resources = {"node_count": nodes, "process_count_per_node": 1, "max_restarts": 0}
        return job_spec(dataset, dataset, name=name, priority=priority, resources=resources)

    # One node runs a job that never ends; a job asking for every node then waits first in
    # line (it fits once that node frees up), and the queue waits behind it.
    assert (await user.post("/v1/jobs", json=spec("holder", 5))).status_code == 201
    assert await _wait_for(lambda: "holder" in sim.claimed, 60), "the holder job was never claimed"
    r = await user.post("/v1/jobs", json=spec("blocker", 3, args.nodes))
    assert r.status_code == 201, r.text
    _phase(f"holder claimed, blocker queued; writing {args.queued} queued jobs")
    # In a thread: the simulated nodes keep heartbeating while the rows are written.
    fill_from = time.monotonic()
    await asyncio.to_thread(fill_queue, db, (owner, dataset), args.queued, prefix=uuid.uuid4().hex[:6])
    fill_to = time.monotonic()
    _phase(f"queue written in {fill_to - fill_from:.1f} s")
    with db.engine.connect() as conn:
        conn.execute(sa.text("ANALYZE jobs"))
        conn.commit()

    # Idle: heartbeats and parked claims only.
    await asyncio.sleep(3)
    x0, r0, _ = _db_counters(db)
    cpu0 = _cpu_seconds()
    idle_from = time.monotonic()
    await asyncio.sleep(args.idle)
    idle_to = time.monotonic()
    cpu1 = _cpu_seconds()
    x1, r1, _ = _db_counters(db)
    idle = ((x1 - x0) / args.idle, (r1 - r0) / args.idle)
    # Cores each part used in the idle window (PostgreSQL: backends that lived through it).
    idle_cpu = {k: max(0.0, cpu1[k] - cpu0.get(k, 0.0)) / args.idle for k in cpu1}

    _phase(f"idle window done; {args.submit} submissions")
    # Submissions behind the blocker.
    timed: list[tuple[float, int, float]] = []  # (seconds, index, started after the burst's start)
    sem = asyncio.Semaphore(4)

    async def submit(i: int) -> None:
        async with sem:
            start = time.monotonic()
            r = await user.post("/v1/jobs", json=spec(f"burst-{i}", 0))
            timed.append((time.monotonic() - start, i, start - t0))
            assert r.status_code == 201, r.text

    _, _, s0 = _db_counters(db)
    t0 = time.monotonic()
    await asyncio.gather(*(submit(i) for i in range(args.submit)))
    submit_s = time.monotonic() - t0
    latencies = [seconds for seconds, _, _ in timed]
    _phase(
        "slowest submissions (s, index, started at): "
        + ", ".join(f"{a:.3f}/{b}/{c:.2f}" for a, b, c in sorted(timed)[-6:])
    )
    submit_to = time.monotonic()
    await asyncio.sleep(2.5)  # PostgreSQL publishes a backend's counters about once a second
    _, _, s1 = _db_counters(db)
    reaper_looks = (submit_s + 2.5) * args.workers  # has_queued_jobs: one a second per process
    passes = max(0.0, s1 - s0 - reaper_looks) / args.submit

    _phase(f"submissions done; {args.probes} probes")
    # Probes: above the blocker, fit any free node.
    probes: list[float] = []
    for i in range(args.probes):
        name = f"probe-{i}"
        start = time.monotonic()
        r = await user.post("/v1/jobs", json=spec(name, 10))
        assert r.status_code == 201, r.text
        if await _wait_for(lambda name=name: name in sim.claimed, 60):
            probes.append(sim.claimed[name] - start)
        await asyncio.sleep(0.5)

    probes_to = time.monotonic()
    _phase("probes done; timing scheduling passes")
    # Scheduling passes timed from outside: the same function on the live queue, in a process
    # of its own (not this one, whose event loop is busy simulating the nodes).
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _TIME_PASSES, db_url, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    pass_ms = [float(x) for x in out.decode().split()]
    intervals = sorted(set(sim.interval.values()))

    beats_to = time.monotonic()
    sim.stop.set()
    with db.engine.connect() as conn:
        lost = conn.execute(sa.text("SELECT count(*) FROM nodes WHERE status = 'lost'")).scalar_one()
        lost_events = conn.execute(
            sa.text("SELECT count(*) FROM job_events WHERE message LIKE '%stopped heartbeating%'")
        ).scalar_one()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    sim.close()
    await user.aclose()
    await admin.aclose()
    db.dispose()
    window = beats_to - beats_from
    done = [lat for at, lat in sim.beats if beats_from <= at <= beats_to]
    # Heartbeat p99 by phase: after registration until the idle window (split at the bulk write
    # of the queue: before it, while PostgreSQL writes it, after it), the idle window, the
    # submissions (and 2.5 s after), the probes.
    phases = {
        "settling": (beats_from, idle_from),
        "settling before the queue's write": (beats_from, fill_from),
        "settling during the queue's write": (fill_from, fill_to),
        "settling after the queue's write": (fill_to, idle_from),
        "idle": (idle_from, idle_to),
        "submissions": (t0, submit_to + 2.5),
        "probes": (submit_to + 2.5, probes_to),
    }
    by_phase_latencies = {
        phase: [lat for at, lat in sim.beats if start <= at <= end] for phase, (start, end) in phases.items()
    }
    beat_p99_by_phase = {phase: _pct(lats, 0.99) for phase, lats in by_phase_latencies.items()}
    beat_count_by_phase = {phase: len(lats) for phase, lats in by_phase_latencies.items()}
    offered = sum(1 / sim.interval[n] for n in sim.names)
    return {
        "registered_s": registered_s,
        "jobs_per_s": args.submit / submit_s,
        "submit_p50_ms": 1000 * _pct(latencies, 0.5),
        "submit_p99_ms": 1000 * _pct(latencies, 0.99),
        "passes_per_submission": passes,
        "probe_s": probes,
        "beats_done": len(done) / window,
        "beats_offered": offered,
        "intervals": intervals,
        "claim_waits": sorted(set(sim.claim_wait.values())),
        "beat_p99_s": _pct(done, 0.99),
        "beat_p99_by_phase": beat_p99_by_phase,
        "beat_count_by_phase": beat_count_by_phase,
        "fill_s": fill_to - fill_from,
        "beat_errors": sim.beat_errors,
        "pass_ms": pass_ms,
        "lost_nodes": int(lost),
        "lost_events": int(lost_events),
        "idle_cpu": idle_cpu,
        "idle_xact_s": idle[0],
        "idle_rows_s": idle[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=1, help="API processes (torchyard serve --workers)")
    parser.add_argument("--submit", type=int, default=100, help="submissions timed")
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")

    port = free_port()
    with (
        scratch_database("torchyard_scale") as db_url,
        tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp,
    ):
        data_dir = Path(tmp) / "data"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        env.update({"TORCHYARD_DATA_DIR": str(data_dir), "TORCHYARD_DATABASE_URL": db_url})
        log_path = Path(os.environ.get("BENCH_SCALE_LOG", Path(tmp) / "serve.log"))
        with open(log_path, "wb") as out:
            api = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torchyard.cli",
                    "serve",
                    "--port",
                    str(port),
                    "--workers",
                    str(args.workers),
                ],
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
                assert api.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
            result = asyncio.run(run(args, url, db_url, data_dir))
        finally:
            api.terminate()
            try:
                api.wait(60)
            except subprocess.TimeoutExpired:
                api.kill()
                api.wait(10)

    probes = result["probe_s"]
    probe = f"{min(probes):.2f}–{max(probes):.2f} s" if probes else "never claimed"
    passes = result["pass_ms"]
    print(
        f"registration of {args.nodes} nodes: {result['registered_s']:.1f} s; API processes: {args.workers}; "
        f"heartbeat interval handed out at the end: {', '.join(f'{i:g} s' for i in result['intervals'])}; "
        f"claim wait: {', '.join(f'{i:g} s' for i in result['claim_waits'])}"
    )
    by_phase = result["beat_p99_by_phase"]
    counts = result["beat_count_by_phase"]
    print(
        "heartbeat p99 by phase: "
        + ", ".join(f"{k} {v:.2f} s ({counts[k]} heartbeats)" for k, v in by_phase.items())
        + f"; the queue's bulk write took {result['fill_s']:.1f} s"
    )
    cpu = result["idle_cpu"]
    if cpu:
        print(
            "cores used in the idle window: "
            + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
            + f" (of {os.cpu_count()})"
        )
    print(
        "| nodes | queued | POST /v1/jobs | passes per submission | probe submit→claim "
        "| heartbeats done/offered | scheduling pass | lost nodes | idle database |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {args.nodes:,} | {args.queued:,} | {result['jobs_per_s']:.0f} jobs/s, p50 {result['submit_p50_ms']:.0f} ms, "
        f"p99 {result['submit_p99_ms']:.0f} ms | {result['passes_per_submission']:.2f} | {probe} "
        f"| {result['beats_done']:.0f}/{result['beats_offered']:.0f} per s (p99 {result['beat_p99_s']:.2f} s, "
        f"{result['beat_errors']} errors) | p50 {statistics.median(passes):.0f} ms, max {max(passes):.0f} ms "
        f"| {result['lost_nodes']} ({result['lost_events']} placements lost) "
        f"| {result['idle_xact_s']:.0f} transactions/s, {result['idle_rows_s']:,.0f} rows read/s |"
    )


if __name__ == "__main__":
    main()
