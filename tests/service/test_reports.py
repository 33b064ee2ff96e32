"""Report ingestion (worker route) and the metrics/logs read routes, on SQLite and PostgreSQL."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.config import Settings
from service.db.engine import Database
from service.db.models import Job
from service.db.types import utcnow
from service.services.leases import LEASE_HEADER
from service.services.upkeep.upkeep_pass import run_upkeep_pass
from tests.support.factories import auth, create_token
from tests.support.report_helpers import (
    all_metrics,
    finish_job,
    point,
    post_report,
    read_all_logs,
    set_placement,
    start_running_job,
    stored_counts,
)
from torchyard.contract import headers, metrics
from torchyard.contract.reports import MetricIn
from worker.agent.reporting import LEASE_HEADER as AGENT_LEASE_HEADER
from worker.trainer import events as trainer_events

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


def test_metric_names_and_header_agree_across_trainer_agent_and_api() -> None:
    # One definition, in the contract, used by all three.
    # Reports take any safe metric name (a script job's own); the trainer's are the contract's.
    rules = MetricIn.model_fields["name"].metadata
    assert [getattr(r, "pattern", None) for r in rules if getattr(r, "pattern", None)] == [
        metrics.METRIC_NAME_PATTERN
    ]
    assert trainer_events.METRIC_NAMES is metrics.METRIC_NAMES
    assert all(re.fullmatch(metrics.METRIC_NAME_PATTERN, n) for n in metrics.METRIC_NAMES)
    assert AGENT_LEASE_HEADER == LEASE_HEADER == headers.LEASE_HEADER


def _batch() -> dict[str, Any]:
    return {
        "metrics": [point("train.loss", 2.0 - 0.1 * s, 1, s) for s in range(10)]
        + [point("train.lr", 0.01, 1, s) for s in range(10)],
        "logs": [
            {"stream": "rank-0", "offset": 0, "data": "epoch 1 step 1\n"},
            {"stream": "rank-0", "offset": 15, "data": "epoch 1 step 2\n"},
            {"stream": "rank-1", "offset": 0, "data": "hello from rank 1\n"},
        ],
        "progress": {"epoch": 1, "epochs": 5, "step": 9, "total_steps": 50},
    }


def test_batch_is_stored_and_a_retry_duplicates_nothing(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    first = post_report(client, job, **_batch())
    assert first.status_code == 200, first.text
    assert first.json() == {
        "metrics": 20,
        "metrics_duplicate": 0,
        "metrics_dropped": 0,
        "logs": 3,
        "logs_duplicate": 0,
        "progress": True,
        "result": False,
        "tracking": False,
    }
    again = post_report(client, job, **_batch())
    assert again.status_code == 200, again.text
    assert again.json()["metrics"] == 0 and again.json()["metrics_duplicate"] == 20
    assert again.json()["logs"] == 0 and again.json()["logs_duplicate"] == 3
    assert stored_counts(settings, job.job_id) == (20, 3)

    items = all_metrics(client, job)
    assert len(items) == 20
    assert [i["seq"] for i in items] == sorted(i["seq"] for i in items)
    assert set(items[0]) == {"seq", "name", "value", "epoch", "step", "rank", "time", "attempt"}
    assert items[0]["attempt"] == 1
    assert read_all_logs(client, job, "rank-0") == b"epoch 1 step 1\nepoch 1 step 2\n"

    # A batch overlapping the last one stores only what is new.
    overlap = post_report(
        client,
        job,
        metrics=[point("train.loss", 1.0, 1, 9), point("train.loss", 0.9, 1, 10)],
        logs=[
            {"stream": "rank-0", "offset": 15, "data": "epoch 1 step 2\n"},
            {"stream": "rank-0", "offset": 30, "data": "done\n"},
        ],
    )
    assert overlap.json()["metrics"] == 1 and overlap.json()["logs"] == 1
    assert read_all_logs(client, job, "rank-0") == b"epoch 1 step 1\nepoch 1 step 2\ndone\n"


def test_stale_leases_are_refused_and_write_nothing(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    other = start_running_job(settings, client)  # another worker token's job
    url = f"/v1/worker/jobs/{job.job_id}/reports"
    worker = auth(job.worker_token)

    def refused(headers: dict[str, str], path: str = url) -> None:
        r = client.post(path, json=_batch(), headers=headers)
        assert r.status_code == 409, r.text
        assert r.json()["code"] == "StaleLeaseError"

    refused(worker)  # no lease header
    refused({**worker, LEASE_HEADER: "not-a-lease"})
    # Another worker's lease, with that worker's own token or with ours.
    refused({**auth(other.worker_token), LEASE_HEADER: other.lease})
    refused({**worker, LEASE_HEADER: other.lease})
    refused({**auth(other.worker_token), LEASE_HEADER: job.lease})
    # Our lease, for another job.
    refused({**worker, LEASE_HEADER: job.lease}, f"/v1/worker/jobs/{other.job_id}/reports")
    # A lease past its expiry is refused once the reaper has ended its placement (before
    # that, it may only have run out while the API was down: see tests/service/test_reaper_and_outages.py).
    set_placement(settings, job.placement_ids[0], lease_expires_at=utcnow() - timedelta(seconds=1))
    db = Database(settings.sqlalchemy_url)
    run_upkeep_pass(db, settings)
    db.dispose()
    refused(job.worker_headers())
    set_placement(
        settings, job.placement_ids[0], lease_expires_at=utcnow() + timedelta(hours=1), status="done"
    )
    refused(job.worker_headers())

    assert stored_counts(settings, job.job_id) == (0, 0)
    assert stored_counts(settings, other.job_id) == (0, 0)
    shown = client.get(f"/v1/jobs/{job.job_id}", headers=auth(job.user_token)).json()
    assert shown["progress"] == {"epoch": None, "step": None, "fraction": None, "eta_s": None}
    assert shown["best"] is None


def test_routes_check_the_token_role(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    r = client.post(
        f"/v1/worker/jobs/{job.job_id}/reports",
        json=_batch(),
        headers={**auth(job.user_token), LEASE_HEADER: job.lease},
    )
    assert r.status_code == 403
    for path in ("metrics", "logs", "logs/streams", "model"):
        r = client.get(f"/v1/jobs/{job.job_id}/{path}", headers=auth(job.worker_token))
        assert r.status_code == 403, path
    assert client.get(f"/v1/jobs/{job.job_id}/metrics", headers={"Authorization": ""}).status_code == 401


@pytest.mark.parametrize(
    "batch",
    [
        {"metrics": [point("val accuracy!", 1.0, 1, 1)]},  # not a safe metric name
        {"metrics": [{**point("val.loss", 1.0, 1, 1), "time": "2030-01-01T00:00:00"}]},
        {"metrics": [{**point("val.loss", 1.0, 1, 1), "extra": 1}]},
        {"metrics": [point("val.loss", 1.0, -1, 1)]},
        {"metrics": [point("val.loss", 1.0, 1, 1, rank=2)]},  # world size is 2
        {"logs": [{"stream": "rank-2", "offset": 0, "data": "x"}]},  # not this node's rank
        {"logs": [{"stream": "agent-someone-else", "offset": 0, "data": "x"}]},
        {"logs": [{"stream": "../etc", "offset": 0, "data": "x"}]},
        {
            "logs": [{"stream": "file-0/train.log", "offset": 0, "data": "x"}]
        },  # ./logs files: script jobs only
        {"logs": [{"stream": "file-0/../job.json", "offset": 0, "data": "x"}]},
        {"logs": [{"stream": "rank-0", "offset": 0, "data": ""}]},
        {"logs": [{"stream": "rank-0", "offset": 0, "data": "a\x00b"}]},
        {"logs": [{"stream": "rank-0", "offset": 0, "data": "é" * (128 * 1024 + 1)}]},
        {"progress": {"epoch": 1, "epochs": 0, "step": 0, "total_steps": 1}},
        {"result": {"best_epoch": 1, "best": {"val.loss": 0.1}, "stopped_early": "no", "epochs_run": 1}},
        {"metrics": [point("val.loss", 1.0, 1, 1)] * 5001},
        {"unknown": []},
    ],
)
def test_invalid_batches_are_refused_whole(
    client: TestClient, settings: Settings, batch: dict[str, Any]
) -> None:
    job = start_running_job(settings, client)
    batch = {**batch, "logs": [*batch.get("logs", []), {"stream": "rank-0", "offset": 0, "data": "ok\n"}]}
    r = post_report(client, job, **batch)
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "ValidationError"
    assert stored_counts(settings, job.job_id) == (0, 0)


def test_non_finite_values_are_refused(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    body = (
        '{"metrics": [{"name": "val.loss", "value": NaN, "epoch": 1, "step": 1, "rank": 0,'
        ' "time": "2030-01-01T00:00:00+00:00"}]}'
    )
    r = client.post(
        f"/v1/worker/jobs/{job.job_id}/reports",
        content=body,
        headers={**job.worker_headers(), "Content-Type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert stored_counts(settings, job.job_id) == (0, 0)


def test_oversized_report_body_is_refused(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    r = client.post(
        f"/v1/worker/jobs/{job.job_id}/reports",
        content=b"[" + b" " * (17 * 1024 * 1024) + b"]",
        headers={**job.worker_headers(), "Content-Type": "application/json"},
    )
    assert r.status_code == 413
    assert r.json()["code"] == "PayloadTooLargeError"


def test_metrics_pagination_and_name_filters(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    points = []
    for epoch in range(1, 6):
        points += [point("train.loss", 1.0 / epoch, epoch, epoch * 10 + s) for s in range(3)]
        points += [
            point("val.loss", 2.0 / epoch, epoch, epoch * 10 + 2),
            point("val.top1", 0.1 * epoch, epoch, epoch * 10 + 2),
        ]
    assert post_report(client, job, metrics=points).status_code == 200
    url = f"/v1/jobs/{job.job_id}/metrics"
    user = auth(job.user_token)

    # Pages of 7 in seq order, following next_after, cover everything exactly once.
    seen: list[int] = []
    after = 0
    while True:
        page = client.get(url, params={"after": after, "limit": 7}, headers=user).json()
        if not page["items"]:
            assert page["next_after"] == after
            break
        assert len(page["items"]) <= 7
        seen += [i["seq"] for i in page["items"]]
        assert page["next_after"] == page["items"][-1]["seq"]
        after = page["next_after"]
    assert len(seen) == len(points) == len(set(seen)) and seen == sorted(seen)

    only_val = client.get(url, params=[("name", "val.loss"), ("name", "val.top1")], headers=user).json()
    assert {i["name"] for i in only_val["items"]} == {"val.loss", "val.top1"}
    assert len(only_val["items"]) == 10
    top1 = client.get(url, params={"name": "val.top1"}, headers=user).json()["items"]
    assert [i["value"] for i in top1] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert [i["epoch"] for i in top1] == [1, 2, 3, 4, 5]
    later = client.get(url, params={"name": "val.top1", "after": top1[2]["seq"]}, headers=user).json()
    assert [i["epoch"] for i in later["items"]] == [4, 5]

    # A poll at the end returns nothing and keeps the cursor.
    end = client.get(url, params={"after": seen[-1]}, headers=user).json()
    assert end == {"items": [], "next_after": seen[-1]}

    for bad in ({"name": "val accuracy!"}, {"limit": 0}, {"limit": 10001}, {"after": -1}):
        r = client.get(url, params=bad, headers=user)
        assert r.status_code == 422, bad
    assert client.get(url, params={"limit": 10000}, headers=user).status_code == 200


def test_several_values_at_one_step_are_kept_in_order_once_and_redone_whole(
    client: TestClient, settings: Settings
) -> None:
    """MLflow keeps several values at one step (``occurrence`` 0, 1...): all are stored, in the
    order logged, a retried report adds none, a point without ``occurrence`` is the first, and
    a later attempt that redoes the step supersedes every value of the earlier one there."""
    from service.db.models import Attempt, Metric

    job = start_running_job(settings, client, per_node=1)
    points = [
        point("loss", 1.0, 0, 5),
        {**point("loss", 2.0, 0, 5), "occurrence": 1},
        point("loss", 3.0, 0, 6),
        point("val.loss", 0.5, 0, 7),
        {**point("val.loss", 0.75, 0, 7), "occurrence": 1},
        {**point("val.top1", 0.25, 0, 7), "occurrence": 0},
        {**point("val.top1", 0.5, 0, 7), "occurrence": 1},
    ]
    first = post_report(client, job, metrics=points)
    assert first.status_code == 200 and first.json()["metrics"] == 7, first.text
    again = post_report(client, job, metrics=points)
    assert again.json()["metrics"] == 0 and again.json()["metrics_duplicate"] == 7
    user = auth(job.user_token)
    url = f"/v1/jobs/{job.job_id}/metrics"
    loss = client.get(url, params={"name": "loss"}, headers=user).json()["items"]
    assert [(p["step"], p["value"]) for p in loss] == [(5, 1.0), (5, 2.0), (6, 3.0)]
    # The lowest val.loss, with the latest other value at its step.
    best = client.get(f"/v1/jobs/{job.job_id}", headers=user).json()["best"]
    assert best == {"attempt": 1, "epoch": 0, "val.loss": 0.5, "val.top1": 0.5}
    bad = post_report(client, job, metrics=[{**point("loss", 1.0, 0, 8), "occurrence": -1}])
    assert bad.status_code == 422 and "occurrence" in bad.text
    # Attempt 2 (not live: one attempt is at a time) redoes step 5 with one value: both of
    # attempt 1's values there are superseded.
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            second = Attempt(job_id=job.job_id, number=2, status="failed", master_addr="127.0.0.1",
                             master_port=29500)  # fmt: skip
            session.add(second)
            session.flush()
            session.add(Metric(job_id=job.job_id, attempt_id=second.id, attempt=2, name="loss", value=9.0,
                               epoch=0, step=5, rank=0, time=utcnow()))  # fmt: skip
    finally:
        db.dispose()
    current = client.get(url, params={"name": "loss"}, headers=user).json()["items"]
    assert [(p["step"], p["value"], p["attempt"]) for p in current] == [(6, 3.0, 1), (5, 9.0, 2)]
    series = client.get(f"/v1/jobs/{job.job_id}/metrics/series", headers=user).json()["series"]
    assert series["loss"] == {"x": [6, 5], "y": [3.0, 9.0], "count": 2}


def test_logs_read_from_any_offset(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    text = "".join(f"line {i} ünïcödé ✓\n" for i in range(200))
    raw = text.encode()
    # Chunks cut at arbitrary character boundaries, as the agent sends them.
    chunks, offset, pos = [], 0, 0
    for size in (1, 17, 300, 4096, 5, 2000, 10**6):
        piece = text[pos : pos + size]
        if not piece:
            break
        chunks.append({"stream": "rank-1", "offset": offset, "data": piece})
        offset += len(piece.encode())
        pos += size
    assert post_report(client, job, logs=chunks).status_code == 200
    url = f"/v1/jobs/{job.job_id}/logs"
    user = auth(job.user_token)

    whole = client.get(url, params={"rank": 1}, headers=user)
    assert whole.status_code == 200
    assert whole.headers["content-type"].startswith("text/plain")
    assert whole.content == raw
    assert whole.headers["X-Next-Offset"] == str(len(raw))
    assert whole.headers["X-Stream-Complete"] == "false"  # the job is still running
    assert whole.headers["X-Log-Stream"] == "rank-1" and whole.headers["X-Log-Attempt"] == "1"

    for start in (0, 1, 18, 19, 2000, len(raw) - 1, len(raw)):
        r = client.get(url, params={"rank": 1, "offset": start, "limit_bytes": 777}, headers=user)
        assert r.content == raw[start : start + 777]
        assert int(r.headers["X-Next-Offset"]) == start + len(r.content)
    beyond = client.get(url, params={"rank": 1, "offset": len(raw) + 10}, headers=user)
    assert beyond.content == b"" and beyond.headers["X-Next-Offset"] == str(len(raw) + 10)

    assert read_all_logs(client, job, "rank-1", limit_bytes=1000) == raw
    # Rank 0 wrote nothing yet; ranks beyond the world size do not exist.
    empty = client.get(url, headers=user)
    assert empty.content == b"" and empty.headers["X-Log-Stream"] == "rank-0"
    assert client.get(url, params={"rank": 2}, headers=user).status_code == 422
    assert client.get(url, params={"rank": 0, "stream": "rank-0"}, headers=user).status_code == 422
    assert client.get(url, params={"stream": "nonsense"}, headers=user).status_code == 422
    assert client.get(url, params={"attempt": 2}, headers=user).status_code == 404

    finish_job(settings, job, "failed")
    done = client.get(url, params={"rank": 1, "offset": 100}, headers=user)
    assert done.headers["X-Stream-Complete"] == "true"
    partial = client.get(url, params={"rank": 1, "offset": 100, "limit_bytes": 10}, headers=user)
    assert partial.headers["X-Stream-Complete"] == "false"  # more to read, though none will be written


def test_agent_stream_and_stream_listing(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client, node_count=2, per_node=2)
    agent0, agent1 = (f"agent-{n}" for n in job.node_names)
    r0 = post_report(client, job, 0, logs=[{"stream": agent0, "offset": 0, "data": "launching torchrun\n"}])
    assert r0.status_code == 200, r0.text
    r1 = post_report(
        client,
        job,
        1,
        logs=[
            {"stream": agent1, "offset": 0, "data": "node 1 up\n"},
            {"stream": "rank-3", "offset": 0, "data": "rank 3 here\n"},
        ],
    )
    assert r1.status_code == 200, r1.text
    # Node rank 1 runs ranks 2 and 3 only.
    assert (
        post_report(client, job, 1, logs=[{"stream": "rank-0", "offset": 0, "data": "x"}]).status_code == 422
    )

    user = auth(job.user_token)
    url = f"/v1/jobs/{job.job_id}/logs"
    assert client.get(url, params={"stream": "agent"}, headers=user).text == "launching torchrun\n"
    assert client.get(url, params={"stream": agent1}, headers=user).text == "node 1 up\n"
    assert client.get(url, params={"stream": "rank-3"}, headers=user).text == "rank 3 here\n"

    listing = client.get(f"{url}/streams", headers=user).json()
    assert listing["attempt"] == 1 and listing["complete"] is False
    sizes = {s["name"]: s["size"] for s in listing["streams"]}
    assert sizes == {agent0: 19, agent1: 10, "rank-0": 0, "rank-1": 0, "rank-2": 0, "rank-3": 12}
    assert [s["name"] for s in listing["streams"]][-4:] == ["rank-0", "rank-1", "rank-2", "rank-3"]
    rank3 = next(s for s in listing["streams"] if s["name"] == "rank-3")
    assert rank3["rank"] == 3 and rank3["node"] is None


def test_metric_points_past_the_jobs_limits_are_dropped_and_said_once(make_settings: Any) -> None:
    settings = make_settings(max_metric_points_per_job=30, max_metric_names_per_job=3)
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        job = start_running_job(settings, client)
        user = auth(job.user_token)
        first = [point("train.loss", 1.0, 1, s) for s in range(20)]
        assert post_report(client, job, metrics=first).json()["metrics"] == 20
        # A retried batch below the limit uses none of the room.
        again = post_report(client, job, metrics=first).json()
        assert (again["metrics"], again["metrics_duplicate"], again["metrics_dropped"]) == (0, 20, 0)

        # Past the limit: the points beyond it go, the rest of the report is kept, no error.
        over = post_report(
            client,
            job,
            metrics=[point("train.loss", 0.5, 2, s) for s in range(20, 40)],
            logs=[{"stream": "rank-0", "offset": 0, "data": "epoch 2\n"}],
            progress={"epoch": 2, "epochs": 5, "step": 39, "total_steps": 100},
        )
        assert over.status_code == 200, over.text
        body = over.json()
        assert (body["metrics"], body["metrics_duplicate"], body["metrics_dropped"]) == (10, 0, 10)
        assert body["logs"] == 1 and body["progress"] is True
        more = post_report(client, job, metrics=[point("train.loss", 0.4, 3, s) for s in range(40, 45)])
        assert more.status_code == 200 and more.json()["metrics_dropped"] == 5
        assert stored_counts(settings, job.job_id) == (30, 2)  # 2 log chunks: rank-0 and the note
        assert [i["step"] for i in all_metrics(client, job)] == list(range(30))
        shown = client.get(f"/v1/jobs/{job.job_id}", headers=user).json()
        assert (shown["metric_points"], shown["metrics_dropped"]) == (30, 15)
        assert shown["progress"]["step"] == 39
        assert read_all_logs(client, job, "rank-0") == b"epoch 2\n"
        # Said once, in the job's service stream (listed with the others); agents cannot write it.
        note = read_all_logs(client, job, "service").decode()
        assert note.count("\n") == 1 and "metric points reported from node" in note
        assert "TORCHYARD_MAX_METRIC_POINTS_PER_JOB" in note and "stored 30 points" in note
        streams = client.get(f"/v1/jobs/{job.job_id}/logs/streams", headers=user).json()["streams"]
        assert {"name": "service", "size": len(note.encode()), "rank": None, "node": None} in streams
        forged = post_report(client, job, logs=[{"stream": "service", "offset": 500, "data": "x"}])
        assert forged.status_code == 422

        # Names: a job keeps at most 3; points of a fourth name go, those of known names stay.
        named = start_running_job(settings, client, user_token=job.user_token)
        r = post_report(
            client, named, metrics=[point(n, 1.0, 1, 0) for n in ("a.x", "b.x", "c.x", "d.x", "e.x")]
        ).json()
        assert (r["metrics"], r["metrics_dropped"]) == (3, 2)
        r = post_report(client, named, metrics=[point("a.x", 2.0, 1, 1), point("f.x", 2.0, 1, 1)]).json()
        assert (r["metrics"], r["metrics_dropped"]) == (1, 1)
        assert sorted({i["name"] for i in all_metrics(client, named)}) == ["a.x", "b.x", "c.x"]
        note = read_all_logs(client, named, "service").decode()
        assert note.count("\n") == 1 and "3 metric names" in note
        shown = client.get(f"/v1/jobs/{named.job_id}", headers=user).json()
        assert (shown["metric_points"], shown["metrics_dropped"]) == (4, 3)
    db = Database(settings.sqlalchemy_url)
    try:
        with db.read_session() as session:
            counted = session.get_one(Job, named.job_id)
            assert (counted.metric_points, counted.metric_names) == (4, 3)
    finally:
        db.dispose()


def test_progress_and_best_metrics_show_on_the_job(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    show = f"/v1/jobs/{job.job_id}"
    user = auth(job.user_token)
    losses = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.5}
    for epoch, loss in losses.items():
        step = epoch * 100
        # The loss and the accuracies of an epoch may arrive in different batches.
        post_report(
            client,
            job,
            metrics=[point("val.loss", loss, epoch, step)],
            progress={"epoch": epoch, "epochs": 6, "step": step, "total_steps": 600},
        )
        post_report(
            client,
            job,
            metrics=[point("val.top1", 1 - loss, epoch, step), point("val.top5", 1.0, epoch, step)],
        )
        shown = client.get(show, headers=user).json()
        assert shown["progress"]["epoch"] == epoch and shown["progress"]["step"] == step
        assert shown["progress"]["epochs"] == 6 and shown["progress"]["total_steps"] == 600
        assert shown["progress"]["fraction"] == pytest.approx(step / 600, abs=1e-4)
        # The ETA needs the rate of two reports; the list shows the same progress, no query of its own.
        eta = shown["progress"]["eta_s"]
        assert (eta is None) if epoch == 1 else (eta >= 0 and shown["progress"]["steps_per_s"] > 0)
        listed = client.get("/v1/jobs", headers=user).json()["items"]
        assert [j["progress"]["step"] for j in listed if j["id"] == job.job_id] == [step]
    # Epoch 2 has the lowest loss; epoch 4 only ties it, so the earlier epoch stays best.
    assert shown["best"] == {"attempt": 1, "epoch": 2, "val.loss": 0.5, "val.top1": 0.5, "val.top5": 1.0}
    assert shown["result"] is None

    result: dict[str, Any] = {
        "best_epoch": 2,
        "best": {"val.loss": 0.5, "val.top1": 0.5, "val.top5": 1.0},
        "final": {"train.loss": 0.3, "val.loss": 0.5, "epoch.seconds": 3.5},
        "stopped_early": True,
        "epochs_run": 4,
    }
    assert post_report(client, job, result=result).status_code == 200
    shown = client.get(show, headers=user).json()
    assert shown["result"] == {"attempt": 1, **result}
    assert shown["best"] == {"attempt": 1, "epoch": 2, **result["best"]}


def test_a_script_jobs_progress_comes_from_its_metric_points(client: TestClient, settings: Settings) -> None:
    from sqlalchemy import update

    from service.db.models import Job
    from tests.service.test_script_jobs_api import upload_code

    job = start_running_job(settings, client)
    code = upload_code(client, {"train.py": b"print('hi')\n"}).json()["id"]
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(update(Job).where(Job.id == job.job_id).values(type="script", code_id=code))
    finally:
        db.dispose()
    show = f"/v1/jobs/{job.job_id}"
    user = auth(job.user_token)
    # Steps without a total: a step, no fraction. Epoch 0 (never logged) is unknown.
    post_report(client, job, metrics=[point("loss", 0.9, 0, 10), point("loss", 0.8, 0, 20, rank=1)])
    progress = client.get(show, headers=user).json()["progress"]
    assert {k: progress[k] for k in ("epoch", "step", "fraction", "eta_s")} == {
        "epoch": None, "step": 20, "fraction": None, "eta_s": None
    }  # fmt: skip
    # The script logs its total: the fraction, and from the next point on an ETA.
    post_report(
        client, job, metrics=[point("progress.total_steps", 200, 0, 0), point("sys.cpu_percent", 99, 1, 500)]
    )
    progress = client.get(show, headers=user).json()["progress"]
    assert (progress["step"], progress["total_steps"], progress["fraction"]) == (20, 200, 0.1)
    post_report(client, job, metrics=[point("loss", 0.5, 1, 50)])
    progress = client.get(show, headers=user).json()["progress"]
    assert (progress["epoch"], progress["step"], progress["fraction"]) == (1, 50, 0.25)
    assert progress["eta_s"] is not None and progress["eta_s"] >= 0


def test_another_users_job_is_not_found(client: TestClient, settings: Settings) -> None:
    job = start_running_job(settings, client)
    assert post_report(client, job, **_batch()).status_code == 200
    stranger = auth(create_token(client, "user"))
    for path in ("metrics", "logs", "logs/streams", "model"):
        r = client.get(f"/v1/jobs/{job.job_id}/{path}", headers=stranger)
        assert r.status_code == 404, path
        assert r.json()["code"] == "NotFoundError"
    # An admin sees every job.
    assert len(client.get(f"/v1/jobs/{job.job_id}/metrics").json()["items"]) == 20


def test_the_agent_batches_within_the_contract_limits() -> None:
    from torchyard.contract import reports as contract_reports
    from worker.agent import run_files

    assert run_files.MAX_BATCH_METRICS <= contract_reports.MAX_METRICS_PER_BATCH
    assert run_files.MAX_BATCH_LOG_CHUNKS <= contract_reports.MAX_LOG_CHUNKS_PER_BATCH
    assert run_files.LOG_READ_BYTES <= contract_reports.MAX_LOG_CHUNK_BYTES
    assert run_files.MAX_BATCH_LOG_BYTES < contract_reports.MAX_REPORT_BODY_BYTES


def _tracking_run(run_id: str, rank: int, **kw: Any) -> dict[str, Any]:
    run = {"id": run_id, "name": f"r{rank}", "experiment": "Default", "status": "RUNNING", "rank": rank,
           "params": {}, "tags": {}}  # fmt: skip
    run.update(kw)
    return run


def test_a_script_jobs_mlflow_runs_show_on_the_job_as_tracking(
    client: TestClient, settings: Settings
) -> None:
    from sqlalchemy import update

    from service.db.models import Job
    from tests.service.test_script_jobs_api import upload_code

    job = start_running_job(settings, client, node_count=2, per_node=1)
    show = f"/v1/jobs/{job.job_id}"
    user = auth(job.user_token)
    a, b = "a" * 32, "b" * 32
    run_a = _tracking_run(a, 0, params={"lr": "0.1"}, tags={"team": "vision", "mlflow.user": "me"})
    # A training job has no MLflow runs: the field is refused, nothing stored.
    r = post_report(client, job, tracking={"runs": [run_a]})
    assert r.status_code == 422 and "script jobs" in r.text
    code = upload_code(client, {"train.py": b"print('hi')\n"}).json()["id"]
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(update(Job).where(Job.id == job.job_id).values(type="script", code_id=code))
    finally:
        db.dispose()
    assert post_report(client, job, tracking={"runs": [run_a]}).status_code == 200
    assert post_report(client, job, tracking={"runs": [run_a]}).status_code == 200  # a retry: no change
    run_b = _tracking_run(b, 1, params={"lr": "0.2", "depth": "3"}, status="FINISHED")
    assert post_report(client, job, node_rank=1, tracking={"runs": [run_b]}).status_code == 200
    run_a["status"] = "FINISHED"
    assert post_report(client, job, tracking={"runs": [run_a]}).status_code == 200  # the node's runs, again
    tracking = client.get(show, headers=user).json()["tracking"]
    assert [(r["id"], r["status"], r["node_rank"], r["attempt"]) for r in tracking["runs"]] == [
        (a, "FINISHED", 0, 1),
        (b, "FINISHED", 1, 1),
    ]
    assert tracking["params"] == {"lr": "0.2", "depth": "3"}  # the later run wins a key
    assert tracking["tags"] == {"team": "vision"}  # MLflow's own mlflow.* tags only on the run
    assert "models" not in tracking  # until a script logs a model (MLflow 3's logged models)
    m = "m-" + "c" * 32
    model = {"id": m, "name": "net", "experiment": "Default", "status": "PENDING", "rank": 1, "run": b,
             "type": None, "artifacts": f"mlflow/models/{m}/artifacts", "params": {"lr": "0.2"}, "tags": {}}  # fmt: skip
    for status in ("PENDING", "READY"):  # the node's runs and models, again
        model["status"] = status
        r = post_report(client, job, node_rank=1, tracking={"runs": [run_b], "models": [model]})
        assert r.status_code == 200, r.text
    tracking = client.get(show, headers=user).json()["tracking"]
    assert tracking["models"] == [{**model, "attempt": 1, "node_rank": 1}]
    # Bad tracking is a 422 naming the field; the job keeps what it had.
    for bad, words in (
        ({"runs": [_tracking_run("x", 0)]}, "tracking.runs.0.id"),
        ({"runs": [_tracking_run(a, 5)]}, "world size"),
        ({"runs": [_tracking_run(a, 0, params={"k": "v" * 9000})]}, "tracking.runs.0.params"),
        ({"runs": [_tracking_run(a, 0, status="DONE")]}, "tracking.runs.0.status"),
        ({"runs": [], "models": [{**model, "artifacts": "../etc"}]}, "tracking.models.0.artifacts"),
        ({"runs": [], "models": [{**model, "rank": 5}]}, "world size"),
    ):
        r = post_report(client, job, tracking=bad)
        assert r.status_code == 422 and words in r.text, r.text
    assert client.get(show, headers=user).json()["tracking"] == tracking
