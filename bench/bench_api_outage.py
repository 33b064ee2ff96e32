"""Long API outages during a running job: the job trains on, finishes, and its metric
points and log bytes arrive exactly once.

For each ``--outage`` (seconds), in turn, on one ``torchyard serve`` process (SQLite in a
temporary data directory, the product's default lease and heartbeat settings) and one
real worker agent:

1. submit a script job that runs for ``outage + --margin`` seconds and, once a second,
   logs metric ``tick`` (step 0, 1, 2 ...) with ``torchyard.run.log_metric`` and prints one
   fixed-length line (``tick 000000 xxx...``);
2. once it runs and its first points are stored, SIGKILL the API, keep it down for the
   outage, start it again (same port, data directory and database);
3. wait for the job's final status, then check: status ``succeeded``, one attempt
   (``restarts`` 0), every step ``0 .. n-1`` stored exactly once (the metric history with
   ``include_superseded=true``, which shows every stored point), and rank 0's log equal,
   byte for byte, to what the script printed (every line once, in order).

Prints a table: outage, job status, attempts (restarts), points expected / stored /
duplicated / missing, log bytes expected / stored (lines missing / doubled), and the time
from the API answering ``/readyz`` again to the first new metric point stored.

Usage (from the repository root; the test helpers are reused)::

    python -m bench.bench_api_outage --outage 25 --outage 120
    python -m bench.bench_api_outage --outage 600
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.support.api_process import ApiProcess
from tests.support.factories import auth
from tests.support.worker_fixtures import start_agent, user_client, wait_for_node, worker_token

TICK = """\
import sys, time
from torchyard import run

n = int(sys.argv[1])
start = time.monotonic()
for i in range(n):
    run.log_metric("tick", float(i), step=i)
    print(f"tick {i:06d} " + "x" * 40, flush=True)
    time.sleep(max(0.0, start + i + 1 - time.monotonic()))
"""
FINAL = {"succeeded", "failed", "cancelled"}


def expected_log(n: int) -> bytes:
    return b"".join(f"tick {i:06d} {'x' * 40}\n".encode() for i in range(n))


def code_archive() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        raw = TICK.encode()
        info = tarfile.TarInfo("tick.py")
        info.size = len(raw)
        tf.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def get(http: httpx.Client, path: str, **params: Any) -> httpx.Response | None:
    """One GET; None while the API cannot be reached or answers 5xx."""
    with contextlib.suppress(httpx.TransportError):
        r = http.get(path, params=params)
        if r.status_code < 500:
            return r
    return None


def stored_points(http: httpx.Client, job_id: str, after: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Every stored point of the job after seq ``after`` (all attempts), and the last seq."""
    points: list[dict[str, Any]] = []
    while True:
        r = http.get(
            f"/v1/jobs/{job_id}/metrics",
            params={"after": after, "limit": 10000, "include_superseded": "true"},
        )
        r.raise_for_status()
        body = r.json()
        points += body["items"]
        if not body["items"]:
            return points, after
        after = body["next_after"]


def stored_log(http: httpx.Client, job_id: str) -> bytes:
    data = b""
    offset = 0
    while True:
        r = http.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0, "offset": offset, "limit_bytes": 1 << 24})
        r.raise_for_status()
        data += r.content
        nxt = int(r.headers["X-Next-Offset"])
        if nxt == offset or r.headers.get("X-Stream-Complete") == "true":
            return data
        offset = nxt


def one_outage(
    api: ApiProcess, user: httpx.Client, code: str, outage: float, margin: float
) -> dict[str, Any]:
    n = int(outage + margin)
    r = user.post(
        "/v1/jobs",
        json={
            "type": "script",
            "code": code,
            "command": ["python", "tick.py", str(n)],
            "resources": {"node_count": 1, "process_count_per_node": 1, "max_restarts": 0},
        },
    )
    assert r.status_code == 201, r.text
    job_id: str = r.json()["id"]

    # Wait until the job runs and its first points are stored, then kill the API.
    deadline = time.monotonic() + 300
    while True:
        points, last_seq = stored_points(user, job_id)
        if len(points) >= 3:
            break
        assert time.monotonic() < deadline, (
            f"job {job_id} never reported: {user.get(f'/v1/jobs/{job_id}').text}"
        )
        time.sleep(0.3)
    before = len(points)
    api.kill()
    killed = time.monotonic()
    print(f"  outage {outage:g} s: API SIGKILLed with {before} points stored", flush=True)
    time.sleep(max(0.0, outage - (time.monotonic() - killed)))
    api.start()
    api.wait_ready(timeout=300)
    back = time.monotonic()
    down = back - killed
    answer = get(user, f"/v1/jobs/{job_id}")
    when_back = answer.json()["status"] if answer is not None and answer.status_code == 200 else "?"

    # Time to the first point stored by the new API process.
    first_new: float | None = None
    deadline = time.monotonic() + 300
    while first_new is None and time.monotonic() < deadline:
        answer = get(user, f"/v1/jobs/{job_id}/metrics", after=last_seq, limit=1, include_superseded="true")
        if answer is not None and answer.status_code == 200 and answer.json()["items"]:
            first_new = time.monotonic() - back
        else:
            time.sleep(0.05)

    job: dict[str, Any] = {}
    deadline = time.monotonic() + n + 600
    while time.monotonic() < deadline:
        answer = get(user, f"/v1/jobs/{job_id}")
        if answer is not None and answer.status_code == 200 and answer.json()["status"] in FINAL:
            job = answer.json()
            break
        time.sleep(0.5)
    else:
        job = {"status": "not final in time", "restarts": None, "attempts": []}

    points, _ = stored_points(user, job_id)
    steps = Counter(p["step"] for p in points if p["name"] == "tick")
    log = stored_log(user, job_id)
    want = expected_log(n)
    lines = Counter(log.splitlines())
    return {
        "job": job_id,
        "outage": outage,
        "down": down,
        "when_back": when_back,
        "status": job["status"],
        "failure": job.get("failure"),
        "attempts": len(job.get("attempts") or []),
        "restarts": job.get("restarts"),
        "expected": n,
        "stored": sum(steps.values()),
        "duplicated": sum(c - 1 for c in steps.values() if c > 1),
        "missing": sum(1 for i in range(n) if i not in steps),
        "log_expected": len(want),
        "log_stored": len(log),
        "log_identical": log == want,
        "lines_missing": sum(1 for line in want.splitlines() if line not in lines),
        "lines_doubled": sum(c - 1 for c in lines.values() if c > 1),
        "first_new": first_new,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--outage", type=float, action="append", help="seconds the API stays down (repeatable)"
    )
    parser.add_argument("--margin", type=float, default=40.0, help="seconds the job runs beyond the outage")
    args = parser.parse_args()
    outages = args.outage or [25.0]

    tmp = Path(tempfile.mkdtemp(prefix="bench-api-outage-"))
    api = ApiProcess(tmp / "data", None).start().wait_ready()
    admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60)
    user = user_client(admin, api.url)
    agent = start_agent(api.url, worker_token(admin), "n1", tmp / "n1", slots=1)
    results = []
    started = time.monotonic()
    try:
        wait_for_node(user, "n1", timeout=120)
        r = user.post(
            "/v1/code",
            data={"name": "tick"},
            files={"file": ("src.tar.gz", code_archive(), "application/gzip")},
        )
        assert r.status_code == 201, r.text
        code = r.json()["id"]
        for outage in outages:
            results.append(one_outage(api, user, code, outage, args.margin))
            print(f"  {results[-1]}", flush=True)
    finally:
        agent.stop(timeout=60)
        api.terminate()
    agent_log = agent.log_text()
    full = [line for line in agent_log.splitlines() if "buffer full" in line]

    print(f"machine: {platform.machine()}, {platform.system()}; {time.monotonic() - started:.0f} s in all")
    print(
        "| outage (API down, s) | job status when the API was back / final | attempts (restarts) | points expected / stored / "
        "duplicated / missing | rank-0 log bytes expected / stored (identical) | "
        "first new point after the API was back |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    ok = True
    for x in results:
        first = "never" if x["first_new"] is None else f"{x['first_new']:.1f} s"
        print(
            f"| {x['outage']:g} ({x['down']:.1f}) | {x['when_back']} / {x['status']} | {x['attempts']} ({x['restarts']}) "
            f"| {x['expected']} / {x['stored']} / {x['duplicated']} / {x['missing']} "
            f"| {x['log_expected']} / {x['log_stored']} ({'yes' if x['log_identical'] else 'NO'}) "
            f"| {first} |"
        )
        if x["failure"]:
            print(f"  failure: {x['failure']}")
        ok = ok and (
            x["status"] == "succeeded"
            and x["restarts"] == 0
            and x["stored"] == x["expected"]
            and x["log_identical"]
        )
    print(f"agent log lines about a full report buffer: {len(full)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
