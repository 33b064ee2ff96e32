"""The agent's RunReporter against a live API: growing files, outages, lost responses, lost leases."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from service.db.engine import Database
from service.services.log_reads import log_chunks_after
from tests.conftest import LiveServer, free_port
from tests.support.factories import auth
from tests.support.report_helpers import (
    RunningJob,
    all_metrics,
    read_all_logs,
    serve_on,
    set_placement,
    start_running_job,
)
from worker.agent import reporting
from worker.agent.reporting import RunReporter, _clean_text, _utf8_complete_prefix


def _wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


class RunFiles:
    """What torchrun and the trainer leave in a run directory, written a bit at a time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.events = root / "events.jsonl"
        self.logs = root / "logs"
        self.agent_log = root / "agent.log"
        self.logs.mkdir(parents=True)
        self.metrics_written = 0
        self.step = 0

    def sources(self) -> list[tuple[str, Path]]:
        # Files appear late, as torchrun creates them; stdout and stderr share a stream.
        return [
            (f"rank-{p.name.split('.')[0]}", p)
            for p in sorted(self.logs.iterdir())
            if p.suffix in (".out", ".err")
        ]

    def append(self, path: Path, data: bytes) -> None:
        with open(path, "ab") as fh:
            fh.write(data)

    def metric_lines(self, n: int, *, torn: bool = False) -> None:
        lines = ""
        for _ in range(n):
            self.step += 1
            event = {
                "type": "metric",
                "name": "train.loss",
                "value": 1.0 / self.step,
                "epoch": 1 + self.step // 100,
                "step": self.step,
                "rank": 0,
                "time": 1_900_000_000 + self.step,
            }
            lines += json.dumps(event) + "\n"
            self.metrics_written += 1
        progress = {
            "type": "progress",
            "epoch": 1 + self.step // 100,
            "epochs": 9,
            "step": self.step,
            "total_steps": 900,
        }
        lines += json.dumps(progress) + "\n"
        if torn:  # half a line: the reporter must wait for the rest
            half = len(lines) // 2
            self.append(self.events, lines[:half].encode())
            time.sleep(0.7)
            self.append(self.events, lines[half:].encode())
        else:
            self.append(self.events, lines.encode())


@pytest.fixture
def worker_client(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url) as c:
        yield c


def _admin(server: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=auth(server.admin_token))


def _reporter(client: httpx.Client, job: RunningJob, files: RunFiles, **kwargs: Any) -> RunReporter:
    client.headers.update(auth(job.worker_token))
    return RunReporter(
        client, job.job_id, job.lease, files.root, files.sources, files.agent_log, job.node_names[0], **kwargs
    )


def test_utf8_and_nul_handling() -> None:
    check = "✓".encode()  # 3 bytes
    assert _utf8_complete_prefix(b"abc") == 3
    assert _utf8_complete_prefix(b"ab" + check[:1]) == 2
    assert _utf8_complete_prefix(b"ab" + check[:2]) == 2
    assert _utf8_complete_prefix(b"ab" + check) == 5
    assert _utf8_complete_prefix(b"\x80\x80") == 2  # stray continuation bytes are not held back
    assert _clean_text(b"a\x00b\xffc") == "a\ufffdb\ufffdc"


def test_reporter_ships_growing_files_across_an_api_outage(settings: Settings, tmp_path: Path) -> None:
    """Files grow while the API goes away and comes back on the same address: every
    point and every byte arrives exactly once, in order."""
    port = free_port()
    server = serve_on(settings, port)
    admin = _admin(server)
    job = start_running_job(settings, admin)
    files = RunFiles(tmp_path / "run")
    client = httpx.Client(base_url=server.url)
    reporter = _reporter(client, job, files, interval=0.1, max_backoff=0.5)
    reporter.start()
    agent_text = b""
    out0, err0, out1 = files.logs / "0.out", files.logs / "0.err", files.logs / "1.out"
    try:
        files.metric_lines(50)
        files.append(out0, b"starting rank 0\n")
        agent_text += b"launching torchrun\n"
        files.append(files.agent_log, b"launching torchrun\n")
        _wait_for(lambda: reporter.stats["metrics"] >= 50)

        for i in range(20):
            files.append(out0, f"step {i} ✓\n".encode())
            files.append(err0, f"warning {i}\n".encode())
            files.append(out1, f"rank 1 step {i}\n".encode())
            time.sleep(0.02)
        files.metric_lines(30, torn=True)

        server.stop()
        # While the API is away: more output, a multi-byte character split across writes.
        files.metric_lines(120)
        files.append(out1, "split ✓".encode()[:-1])
        time.sleep(1.0)
        files.append(out1, "split ✓".encode()[-1:] + b" done\n")
        files.append(files.agent_log, b"api unreachable\n")
        agent_text += b"api unreachable\n"
        time.sleep(1.0)
        assert reporter.stats["retries"] > 0

        server = serve_on(settings, port)
        files.metric_lines(40)
        files.append(out0, b"finished\n")
    finally:
        drained = reporter.stop(timeout=30)
        client.close()
    assert drained and not reporter.lease_lost
    admin = _admin(server)
    try:
        items = all_metrics(admin, job)
        assert len(items) == files.metrics_written == 240
        assert sorted(i["step"] for i in items) == list(range(1, 241))
        assert [i["step"] for i in items] == sorted(i["step"] for i in items)  # shipped in order
        assert all(i["time"].startswith("2030-") for i in items)

        rank0 = read_all_logs(admin, job, "rank-0")
        # stdout and stderr interleave in one stream; each file's bytes stay in order.
        assert len(rank0) == out0.stat().st_size + err0.stat().st_size
        assert sorted(rank0.splitlines(keepends=True)) == sorted(
            (out0.read_bytes() + err0.read_bytes()).splitlines(keepends=True)
        )
        assert read_all_logs(admin, job, "rank-1") == out1.read_bytes()
        assert read_all_logs(admin, job, f"agent-{job.node_names[0]}") == agent_text

        shown = admin.get(f"/v1/jobs/{job.job_id}").json()
        assert shown["progress"]["step"] == 240
    finally:
        admin.close()
        server.stop()


class _LoseResponses(httpx.BaseTransport):
    """Delivers every request, but loses the answer to every other report (a timeout after
    the API committed), so each of those batches is sent again."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.reports = 0
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path.endswith("/reports"):
            self.reports += 1
            if self.reports % 2 == 1:
                response.read()
                response.close()
                self.lost += 1
                raise httpx.ReadTimeout("answer lost", request=request)
        return response


@pytest.mark.both_databases
def test_a_batch_resent_after_a_lost_answer_is_not_stored_twice(
    settings: Settings, live_server: LiveServer, tmp_path: Path
) -> None:
    admin = _admin(live_server)
    job = start_running_job(settings, admin)
    files = RunFiles(tmp_path / "run")
    transport = _LoseResponses(httpx.HTTPTransport())
    client = httpx.Client(base_url=live_server.url, transport=transport)
    reporter = _reporter(client, job, files, interval=0.05, max_backoff=0.1)
    reporter.start()
    try:
        for i in range(10):
            files.metric_lines(7)
            files.append(files.logs / "0.out", f"line {i}\n".encode())
            time.sleep(0.15)
    finally:
        assert reporter.stop(timeout=30)
        client.close()
    assert transport.lost >= 3
    items = all_metrics(admin, job)
    assert len(items) == files.metrics_written == 70
    assert read_all_logs(admin, job, "rank-0") == (files.logs / "0.out").read_bytes()
    admin.close()


def test_memory_stays_bounded_while_the_api_is_down(settings: Settings, tmp_path: Path) -> None:
    """Nothing is read ahead of the batch waiting to be sent: positions stay put."""
    admin_server = serve_on(settings, free_port())
    admin = _admin(admin_server)
    job = start_running_job(settings, admin)
    files = RunFiles(tmp_path / "run")
    big = b"x" * 1000 + b"\n"
    for name in ("0.out", "1.out"):
        files.append(files.logs / name, big * 3000)  # 3 MB each
    files.metric_lines(5000)
    dead = httpx.Client(base_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    reporter = _reporter(dead, job, files, interval=0.05, max_backoff=0.2)
    reporter.start()
    try:
        _wait_for(lambda: reporter.stats["retries"] >= 3)
        read_logs = sum(f.position for f in reporter._files.values())
        assert 0 < read_logs <= reporter_limit()
        assert reporter.stats["batches"] == 0
    finally:
        assert reporter.stop(timeout=0.5) is False  # the API never came back
        dead.close()
    admin.close()
    admin_server.stop()


def reporter_limit() -> int:
    return reporting.MAX_BATCH_LOG_BYTES


def test_a_stale_lease_stops_the_reporter(
    settings: Settings, live_server: LiveServer, tmp_path: Path
) -> None:
    admin = _admin(live_server)
    job = start_running_job(settings, admin)
    files = RunFiles(tmp_path / "run")
    client = httpx.Client(base_url=live_server.url)
    reporter = _reporter(client, job, files, interval=0.05)
    reporter.start()
    files.metric_lines(3)
    _wait_for(lambda: reporter.stats["metrics"] == 3)
    set_placement(settings, job.placement_ids[0], status="done")
    files.metric_lines(3)
    _wait_for(lambda: reporter.lease_lost)
    assert reporter._thread is not None
    reporter._thread.join(5)
    assert not reporter._thread.is_alive()
    assert reporter.stop(timeout=1) is False
    assert len(all_metrics(admin, job)) == 3
    client.close()
    admin.close()


def test_stop_without_start_drains_everything(
    settings: Settings, live_server: LiveServer, tmp_path: Path
) -> None:
    admin = _admin(live_server)
    job = start_running_job(settings, admin)
    files = RunFiles(tmp_path / "run")
    files.metric_lines(2500)  # more than one batch holds
    files.append(files.logs / "1.out", b"y" * (3 * reporting.MAX_BATCH_LOG_BYTES))
    files.append(files.events, b'{"type": "metric", "name": "bogus", "value": 1}\nnot json\n')
    result = {
        "type": "result",
        "best_epoch": 3,
        "best": {"val.loss": 0.2, "val.top1": 0.9, "not.a.metric": 1},
        "final": {"train.loss": 0.1},
        "stopped_early": False,
        "epochs_run": 5,
    }
    files.append(files.events, (json.dumps(result) + "\n").encode())
    with httpx.Client(base_url=live_server.url) as client:
        reporter = _reporter(client, job, files)
        assert reporter.stop(timeout=60)
    assert reporter.stats["batches"] >= 3  # 1 MiB of log per batch
    assert len(all_metrics(admin, job)) == 2500
    assert read_all_logs(admin, job, "rank-1") == b"y" * (3 * reporting.MAX_BATCH_LOG_BYTES)
    shown = admin.get(f"/v1/jobs/{job.job_id}").json()
    assert shown["result"]["best"] == {"val.loss": 0.2, "val.top1": 0.9}
    assert shown["best"] == {"attempt": 1, "epoch": 3, "val.loss": 0.2, "val.top1": 0.9}
    admin.close()


@pytest.mark.both_databases
def test_two_nodes_report_at_the_same_time(
    settings: Settings, live_server: LiveServer, tmp_path: Path
) -> None:
    """Both nodes of a job write concurrently (they share the job's lock); followers reading
    by seq see each stream in offset order."""
    admin = _admin(live_server)
    job = start_running_job(settings, admin, node_count=2, per_node=1)
    reporters, runs, clients = [], [], []
    for node_rank in (0, 1):
        files = RunFiles(tmp_path / f"run-{node_rank}")
        client = httpx.Client(base_url=live_server.url, headers=auth(job.worker_token))
        reporter = RunReporter(
            client,
            job.job_id,
            job.leases[node_rank],
            files.root,
            files.sources,
            files.agent_log,
            job.node_names[node_rank],
            interval=0.02,
        )
        reporter.start()
        reporters.append(reporter)
        runs.append(files)
        clients.append(client)
    try:
        for i in range(60):
            runs[0].metric_lines(5)
            for node_rank, files in enumerate(runs):
                files.append(files.logs / f"{node_rank}.out", f"node {node_rank} line {i}\n".encode() * 20)
                files.append(files.agent_log, f"agent {node_rank} tick {i}\n".encode())
            time.sleep(0.01)
    finally:
        assert all(r.stop(timeout=30) for r in reporters)
        for client in clients:
            client.close()
    assert len(all_metrics(admin, job)) == 300
    for node_rank, files in enumerate(runs):
        assert (
            read_all_logs(admin, job, f"rank-{node_rank}") == (files.logs / f"{node_rank}.out").read_bytes()
        )
        assert read_all_logs(admin, job, f"agent-{job.node_names[node_rank]}") == files.agent_log.read_bytes()

    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as session:
            pieces = log_chunks_after(session, job.job_id, None, 0, limit=100_000)
        ends: dict[str, int] = {}
        for piece in pieces:
            assert piece.offset == ends.get(piece.stream, 0), piece.stream  # contiguous, in seq order
            ends[piece.stream] = piece.offset + len(piece.data.encode())
        assert len(ends) == 4
    finally:
        db.dispose()
    admin.close()
