"""The web UI's job page with 100,000 metric points: load and draw time in Chromium.

Starts ``torchyard serve`` (SQLite in a temporary data dir), writes a running job with
``--points`` metric points straight into its database (train.loss, train.lr and
train.images_per_sec every step, the validation metrics every epoch), then opens the
job's page in headless Chromium (Debian's package, driven by Playwright) and measures,
for ``--repeats`` fresh page loads:

* page: navigation start → every chart drawn (the page's ``#charts[data-ready]``),
  which covers the HTML, the scripts, the job, the reduced series and the drawing; also
  read in the page (its ``torchyard:charts-ready`` mark, from navigation start). Each
  load is done twice: with nothing reported since the last load (the server answers the
  reduced series from memory) and after one new point was written (the server reduces
  the 100,000 points again, as for a job that is training);
* series: the ``GET /v1/jobs/{id}/metrics/series`` answer alone (server-side min/max
  decimation to 2,000 points per metric), timed with httpx: the first answer, answers
  from memory, and answers after a new point;
* CPU time: the API process's (for the page: it, Chromium's and Playwright's driver's)
  user + system time over the same spans, read from /proc: on a machine shared with other work wall time stretches with
  the load, CPU time is about what the work takes on an idle one;
* client draw: one ``LineChart`` fed all points of the largest metric unreduced, timed
  in the page (``chart.js``: uPlot's draw, which keeps each pixel column's lowest and
  highest value).

With ``--compare N`` it also writes N more such jobs and times the compare page
(``#/compare?ids=…``, all N jobs): navigation → every chart drawn with a line per job
(the page's ``#compare-charts[data-ready]``), and the ``GET /v1/jobs/compare`` answer
alone.

Usage::

    python bench/bench_ui.py                      # 100,000 points, 5 page loads
    python bench/bench_ui.py --points 1000000 --repeats 3
    python bench/bench_ui.py --compare 20         # and 20 jobs x 100,000 points compared
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import insert, select

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Dataset, Job, Metric
from service.db.types import utcnow

TRAIN = ("train.loss", "train.lr", "train.images_per_sec")
VAL = ("val.loss", "val.top1", "val.top5", "epoch.seconds")


def cpu_seconds(root: int) -> float:
    """User + system CPU time used so far by ``root``'s descendants (not ``root`` itself).

    On a machine shared with other work, wall time stretches with the load; CPU time is
    about what the same work takes in wall time on an idle machine."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total = 0.0
    for pid, seconds in used.items():
        up = parent.get(pid)
        while up is not None and up > 1:
            if up == root:
                total += seconds
                break
            up = parent.get(up)
    return total


def own_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Service:
    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-ui-")
        self.data_dir = Path(self.tmp.name) / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        env["TORCHYARD_DATA_DIR"] = str(self.data_dir)
        env.update(settings or {})
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
        self.database_url = Settings(data_dir=self.data_dir).sqlalchemy_url

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        self.log.close()
        self.tmp.cleanup()


def write_job(service: Service, owner_id: str, points: int) -> str:
    """A running job with ``points`` metric points (about), as a long training run leaves them."""
    steps_per_epoch = 250
    steps = max(1, (points * steps_per_epoch) // (len(TRAIN) * steps_per_epoch + len(VAL)))
    db = Database(service.database_url)
    now = utcnow()
    start = now - timedelta(hours=10)
    try:
        with db.transaction() as session:
            dataset = Dataset(
                owner_id=owner_id,
                name="bench",
                source="upload",
                storage_path="unused",
                classes=["a", "b"],
                class_counts={"a": 1, "b": 1},
                num_images=2,
                size_bytes=1,
                sha256="0" * 64,
            )
            session.add(dataset)
            session.flush()
            epochs = steps // steps_per_epoch + 1
            job = Job(
                owner_id=owner_id,
                name="bench-100k",
                status="running",
                spec={
                    "name": "bench-100k",
                    "model": {"architecture": "resnet18", "pretrained": False, "memory_efficient": False},
                    "train_dataset": dataset.id,
                    "validation_dataset": dataset.id,
                    "parameters": {"epochs": epochs},
                    "resources": {"node_count": 1, "process_count_per_node": 1},
                    "priority": 0,
                },
                architecture="resnet18",
                train_dataset_id=dataset.id,
                validation_dataset_id=dataset.id,
                node_count=1,
                process_count_per_node=1,
                attempts_count=1,
                progress={
                    "epoch": epochs - 1,
                    "epochs": epochs,
                    "step": steps,
                    "total_steps": epochs * steps_per_epoch,
                },
                created_at=start,
                updated_at=now,
                scheduled_at=start,
                started_at=start,
            )
            session.add(job)
            session.flush()
            attempt = Attempt(
                job_id=job.id, number=1, status="running", master_addr="127.0.0.1", master_port=29500
            )
            session.add(attempt)
            session.flush()
            rows = []
            for step in range(1, steps + 1):
                epoch = (step - 1) // steps_per_epoch
                t = start + timedelta(seconds=step)
                loss = 2.3 / (1 + step / 2000) + 0.03 * ((step * 7919) % 13) / 13
                for name, value in zip(
                    TRAIN,
                    (loss, 0.1 * (1 - step / steps), 900 + 30 * math.sin(step / 700) + (step * 31) % 7),
                    strict=True,
                ):
                    rows.append({"job_id": job.id, "attempt_id": attempt.id, "name": name, "value": value,
                                 "epoch": epoch, "step": step, "rank": 0, "time": t})  # fmt: skip
                if step % steps_per_epoch == 0:
                    for name, value in zip(VAL, (loss * 1.1, 1 - loss / 3, 1 - loss / 6, 250.0), strict=True):
                        rows.append({"job_id": job.id, "attempt_id": attempt.id, "name": name, "value": value,
                                     "epoch": epoch, "step": step, "rank": 0, "time": t})  # fmt: skip
            for i in range(0, len(rows), 20_000):
                session.execute(insert(Metric), rows[i : i + 20_000])
            print(f"job {job.id}: {len(rows):,} metric points over {steps:,} steps")
            return job.id
    finally:
        db.dispose()


class NewPoints:
    """Writes one more ``train.loss`` point at a time, as a training job reports them: the
    next series answer has to reduce the job's points again."""

    def __init__(self, service: Service, job_id: str) -> None:
        self.database_url = service.database_url
        self.job_id = job_id
        self.step = 10_000_000

    def add(self) -> None:
        self.step += 1
        db = Database(self.database_url)
        try:
            with db.transaction() as session:
                attempt = session.scalars(select(Attempt).where(Attempt.job_id == self.job_id)).one()
                row = {"job_id": self.job_id, "attempt_id": attempt.id, "name": "train.loss", "value": 0.5,
                       "epoch": 0, "step": self.step, "rank": 0, "time": utcnow()}  # fmt: skip
                session.execute(insert(Metric), [row])
        finally:
            db.dispose()


MODES = ("cached", "new point")  # nothing new since the last load; one new point first


def time_series(
    service: Service, user: httpx.Client, job_id: str, new_points: NewPoints, repeats: int
) -> tuple[tuple[float, float], dict[str, tuple[list[float], list[float]]], dict[str, Any]]:
    """The series answer over httpx: the first one, then ``repeats`` of each mode (wall ms, API CPU ms)."""
    serve = service.process.pid

    def timed() -> tuple[float, float, httpx.Response]:
        c0 = own_cpu(serve)
        t0 = time.perf_counter()
        answer = user.get(f"/v1/jobs/{job_id}/metrics/series", params={"points": 2000})
        answer.raise_for_status()
        return (time.perf_counter() - t0) * 1000, (own_cpu(serve) - c0) * 1000, answer

    first_ms, first_cpu_ms, page = timed()
    series: dict[str, tuple[list[float], list[float]]] = {mode: ([], []) for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            if mode == "new point":
                new_points.add()
            ms, cpu, page = timed()
            series[mode][0].append(ms)
            series[mode][1].append(cpu)
    body: dict[str, Any] = page.json()
    return (first_ms, first_cpu_ms), series, body


def time_pages(
    tab: Any, job_id: str, new_points: NewPoints, repeats: int
) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """Fresh loads of the job's page in each mode: wall ms, in-page ms, API + Chromium CPU ms."""
    loads: dict[str, tuple[list[float], list[float], list[float]]] = {mode: ([], [], []) for mode in MODES}
    for _ in range(repeats):
        for mode, (load_ms, in_page_ms, load_cpu_ms) in loads.items():
            if mode == "new point":
                new_points.add()
            tab.goto("about:blank")
            c0 = cpu_seconds(os.getpid())
            t0 = time.perf_counter()
            tab.goto(f"/#/jobs/{job_id}")
            tab.wait_for_selector("#charts[data-ready='true']", timeout=60_000)
            load_ms.append((time.perf_counter() - t0) * 1000)
            load_cpu_ms.append((cpu_seconds(os.getpid()) - c0) * 1000)
            mark = tab.evaluate(
                "performance.getEntriesByName('torchyard:charts-ready')[0].startTime"
                " - performance.getEntriesByType('navigation')[0].startTime"
            )
            in_page_ms.append(float(mark))
    return loads


def time_compare(tab: Any, user: httpx.Client, job_ids: list[str], repeats: int) -> dict[str, list[float]]:
    """The compare answer (httpx, first and again) and fresh loads of the compare page (ms)."""
    ids = ",".join(job_ids)
    out: dict[str, list[float]] = {"answer": [], "page": [], "in page": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = user.get("/v1/jobs/compare", params={"ids": ids, "points": 2000})
        r.raise_for_status()
        out["answer"].append((time.perf_counter() - t0) * 1000)
    for _ in range(repeats):
        tab.goto("about:blank")
        t0 = time.perf_counter()
        tab.goto(f"/#/compare?ids={ids}")
        tab.wait_for_selector("#compare-charts[data-ready='true']", timeout=120_000)
        out["page"].append((time.perf_counter() - t0) * 1000)
        mark = tab.evaluate(
            "performance.getEntriesByName('torchyard:compare-ready')[0].startTime"
            " - performance.getEntriesByType('navigation')[0].startTime"
        )
        out["in page"].append(float(mark))
    return out


def time_draw(tab: Any, xs: list[float], ys: list[float], repeats: int) -> list[float]:
    """One ``LineChart`` fed every point unreduced, drawn ``repeats`` times (ms each)."""
    out = []
    for _ in range(repeats):
        ms = tab.evaluate(
            """async ([xs, ys]) => {
                const { LineChart } = await import('/ui/chart.js');
                const root = document.createElement('div');
                root.style.width = '600px';
                document.body.append(root);
                const chart = new LineChart(root, {title: 'full', series: [{name: 'a', label: 'a'}]});
                chart.setData('a', xs, ys);
                const ms = await chart.draw();
                chart.destroy();
                root.remove();
                return ms;
            }""",
            [xs, ys],
        )
        out.append(float(ms))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--compare", type=int, default=0, help="also compare this many such jobs (at most 20)"
    )
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    service = Service()
    try:
        admin = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.admin_token}"})
        token = admin.post("/v1/tokens", json={"name": "bench-user", "role": "user"}).json()["token"]
        owner_id = httpx.get(f"{service.url}/v1/whoami", headers={"Authorization": f"Bearer {token}"}).json()[
            "id"
        ]
        job_id = write_job(service, owner_id, args.points)
        compared = [write_job(service, owner_id, args.points) for _ in range(min(args.compare, 20))]
        new_points = NewPoints(service, job_id)

        user = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        (first_ms, first_cpu_ms), series, body = time_series(service, user, job_id, new_points, args.repeats)
        drawn = sum(len(s["x"]) for s in body["series"].values())
        stored = sum(s["count"] for s in body["series"].values())

        with sync_playwright() as pw:
            extra = ["--no-sandbox"] if os.geteuid() == 0 else []
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True, args=extra)
            context = browser.new_context(base_url=service.url, viewport={"width": 1280, "height": 900})
            tab = context.new_page()
            tab.goto("/")
            tab.fill("#token", token)
            tab.click("#signin-submit")
            tab.wait_for_selector("#whoami")
            loads = time_pages(tab, job_id, new_points, args.repeats)
            full = user.get(f"/v1/jobs/{job_id}/metrics/series", params={"points": 100_000}).json()["series"][
                "train.loss"
            ]
            draw_ms = time_draw(tab, full["x"], full["y"], args.repeats)
            comparing = time_compare(tab, user, compared, args.repeats) if compared else None
            browser.close()
    finally:
        service.stop()

    load = os.getloadavg()
    print(f"points stored: {stored:,}; points sent to the page: {drawn:,} (2,000 asked per metric)")
    print(f"series answer (httpx), first: {first_ms:7.1f} ms; API process CPU time {first_cpu_ms:7.1f} ms")
    for mode, (ms_list, cpu_list) in series.items():
        print(
            f"series answer, {mode + ':':11s}  median {statistics.median(ms_list):7.1f} ms"
            f"  max {max(ms_list):7.1f} ms; API CPU median {statistics.median(cpu_list):7.1f} ms"
        )
    for mode, (load_ms, in_page_ms, load_cpu_ms) in loads.items():
        print(
            f"page load → charts drawn, {mode + ':':11s} median {statistics.median(load_ms):7.1f} ms"
            f"  max {max(load_ms):7.1f} ms"
        )
        print(
            f"  in the page, from navigation: median {statistics.median(in_page_ms):7.1f} ms"
            f"  max {max(in_page_ms):7.1f} ms"
        )
        print(f"  API + Chromium CPU time:      median {statistics.median(load_cpu_ms):7.1f} ms")
    print(
        f"client draw of {len(full['x']):,} unreduced points: median {statistics.median(draw_ms):.1f} ms"
        f"  max {max(draw_ms):.1f} ms"
    )
    if comparing is not None:
        print(f"compare {len(compared)} jobs x {args.points:,} points:")
        for what, values in comparing.items():
            print(f"  {what + ':':9s} median {statistics.median(values):7.1f} ms  max {max(values):7.1f} ms")
    print(f"load average: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
