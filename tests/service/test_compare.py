"""``GET /v1/jobs/compare``: several jobs side by side (parameters that differ, what a script's
MLflow runs logged, best and final values with their epoch or step, duration, images/s,
reduced series), the CLI's ``compare`` and the Python client, and the refusals: unknown or
foreign jobs, more than 20, an unknown metric."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.services.compare import logged_rows
from tests.conftest import LiveServer
from tests.support.factories import auth, create_token
from tests.support.report_helpers import (
    RunningJob,
    finish_job,
    make_script_job,
    point,
    post_report,
    start_running_job,
)
from torchyard.client import Client, JobComparison
from torchyard.commands import comparison_text


def _job(
    client: TestClient, settings: Settings, user: str, lr: float, top1: list[float], **kw: Any
) -> RunningJob:
    job = start_running_job(
        settings, client, per_node=1, user_token=user, parameters={"learning_rate": lr, "epochs": 3}, **kw
    )
    points = []
    for epoch, value in enumerate(top1, start=1):
        points.append(point("val.top1", value, epoch=epoch, step=epoch * 10))
        points.append(point("val.loss", 1.0 - value, epoch=epoch, step=epoch * 10))
        points.append(point("train.images_per_sec", 100.0 * epoch, epoch=epoch, step=epoch * 10))
    assert post_report(client, job, metrics=points).status_code == 200
    return job


@pytest.fixture
def three(client: TestClient, settings: Settings) -> tuple[str, list[RunningJob]]:
    user = create_token(client, "user", "ann")
    a = _job(client, settings, user, 0.1, [0.5, 0.9, 0.8], name="lr-a")
    b = _job(client, settings, user, 0.01, [0.3, 0.4, 0.6], name="lr-b")
    c = _job(client, settings, user, 0.1, [0.7, 0.7, 0.7], name="lr-c")
    finish_job(settings, a, status="failed")
    return user, [a, b, c]


def test_compare_gives_differing_parameters_best_final_and_series(
    client: TestClient, three: tuple[str, list[RunningJob]]
) -> None:
    user, (a, b, c) = three
    r = client.get(
        "/v1/jobs/compare",
        params={"ids": f"{a.job_id},lr-b,{c.job_id[:8]}", "metrics": "val.top1,val.loss"},
        headers=auth(user),
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [j["id"] for j in body["jobs"]] == [a.job_id, b.job_id, c.job_id]
    assert body["metrics"] == ["val.top1", "val.loss"]
    assert body["goals"] == {"val.top1": "max", "val.loss": "min"}
    # The learning rate differs (and each job has a dataset of its own); the names are not
    # parameters, and what every job shares is not listed.
    assert body["differing"] == ["parameters.learning_rate", "train_dataset", "validation_dataset"]
    first = body["jobs"][0]
    assert first["parameters"]["parameters.learning_rate"] == 0.1
    assert first["parameters"]["parameters.epochs"] == 3
    assert first["parameters"]["model.architecture"] == "resnet18"
    assert first["status"] == "failed" and body["jobs"][1]["status"] == "running"
    top1 = first["metrics"]["val.top1"]
    assert top1["best"] == {"value": 0.9, "epoch": 2, "step": 20}
    assert top1["final"] == {"value": 0.8, "epoch": 3, "step": 30}
    assert top1["series"] == {"x": [10, 20, 30], "y": [0.5, 0.9, 0.8], "count": 3}
    loss = first["metrics"]["val.loss"]
    assert loss["best"]["epoch"] == 2 and loss["best"]["value"] == pytest.approx(0.1)
    # Ties: the first epoch that reached the best value.
    assert body["jobs"][2]["metrics"]["val.top1"]["best"]["epoch"] == 1
    assert first["images_per_sec"] == pytest.approx(200.0)
    assert first["duration_s"] is not None and first["duration_s"] >= 0
    # Without metrics=, every metric any job has.
    every = client.get(
        "/v1/jobs/compare", params={"ids": f"{a.job_id},{b.job_id}"}, headers=auth(user)
    ).json()
    assert every["metrics"] == ["train.images_per_sec", "val.loss", "val.top1"]


def test_a_metric_no_job_has_is_an_empty_entry(
    client: TestClient, three: tuple[str, list[RunningJob]]
) -> None:
    user, (a, b, _) = three
    r = client.get(
        "/v1/jobs/compare",
        params={"ids": f"{a.job_id},{b.job_id}", "metrics": "nope.metric"},
        headers=auth(user),
    )
    assert r.status_code == 200, r.text
    entry = r.json()["jobs"][0]["metrics"]["nope.metric"]
    assert entry == {"best": None, "final": None, "series": {"x": [], "y": [], "count": 0}}


def test_unknown_and_foreign_jobs_are_one_404_naming_them(
    client: TestClient, three: tuple[str, list[RunningJob]]
) -> None:
    user, (a, _, _) = three
    other = create_token(client, "user", "bob")
    foreign = start_running_job(client.app.state.settings, client, per_node=1, user_token=other, name="bobs")
    r = client.get(
        "/v1/jobs/compare", params={"ids": f"{a.job_id},nope-job,{foreign.job_id}"}, headers=auth(user)
    )
    assert r.status_code == 404, r.text
    body = r.json()
    assert body["code"] == "NotFoundError"
    assert body["details"]["not_found"] == ["nope-job", foreign.job_id]
    assert "'nope-job'" in body["message"] and foreign.job_id in body["message"]
    # bob sees his own job, not ann's.
    assert client.get("/v1/jobs/compare", params={"ids": a.job_id}, headers=auth(other)).status_code == 404


def test_more_than_twenty_jobs_or_none_is_a_422(
    client: TestClient, three: tuple[str, list[RunningJob]]
) -> None:
    user, _ = three
    many = ",".join(f"job-{i}" for i in range(21))
    r = client.get("/v1/jobs/compare", params={"ids": many}, headers=auth(user))
    assert r.status_code == 422 and r.json()["details"] == {"field": "ids", "limit": 20, "given": 21}
    for ids in ("", ", ,"):
        r = client.get("/v1/jobs/compare", params={"ids": ids}, headers=auth(user))
        assert r.status_code == 422 and r.json()["details"]["field"] == "ids", r.text
    assert client.get("/v1/jobs/compare", headers=auth(user)).status_code == 422
    # The same job named twice (by id and by name) is compared once.
    user_jobs = client.get("/v1/jobs", headers=auth(user)).json()["items"]
    first = user_jobs[0]
    twice = client.get(
        "/v1/jobs/compare", params={"ids": f"{first['id']},{first['name']}"}, headers=auth(user)
    )
    assert [j["id"] for j in twice.json()["jobs"]] == [first["id"]]


def test_cli_text_shows_differing_parameters_and_results(
    client: TestClient, three: tuple[str, list[RunningJob]]
) -> None:
    user, (a, b, _) = three
    body = client.get(
        "/v1/jobs/compare",
        params={"ids": f"{a.job_id},{b.job_id}", "metrics": "val.top1"},
        headers=auth(user),
    ).json()
    text = comparison_text(JobComparison.model_validate(body), width=200)
    lines = text.splitlines()
    assert lines[0].split() == ["PARAMETER", a.job_id[:8], b.job_id[:8]]
    assert lines[1].split() == ["parameters.learning_rate", "0.1", "0.01"]
    assert "parameters.epochs" not in text
    header = next(line for line in lines if line.startswith("JOB"))
    assert "val.top1 BEST (max)" in header and "val.top1 FINAL" in header
    row_a = next(line for line in lines if line.startswith(a.job_id[:8]) and "lr-a" in line)
    assert "0.9 (epoch 2)" in row_a and "failed" in row_a and "200.0" in row_a
    row_b = next(line for line in lines if line.startswith(b.job_id[:8]) and "lr-b" in line)
    assert "0.6 (epoch 3)" in row_b and "running" in row_b


def test_cli_compare_and_the_python_client_over_http(live_server: LiveServer, settings: Settings) -> None:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30) as admin:
        user = create_token(admin, "user", "cy")
        a = _job(admin, settings, user, 0.1, [0.5, 0.9], name="cli-a")  # type: ignore[arg-type]
        b = _job(admin, settings, user, 0.05, [0.6, 0.7], name="cli-b")  # type: ignore[arg-type]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_URL=live_server.url, TORCHYARD_TOKEN=user)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "torchyard.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    text = cli("compare", "cli-a", b.job_id[:6], "--metric", "val.top1")
    assert text.returncode == 0, text.stderr
    assert "parameters.learning_rate" in text.stdout and "0.9 (epoch 2)" in text.stdout
    as_json = cli("compare", "cli-a", "cli-b", "--json")
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    assert [j["id"] for j in body["jobs"]] == [a.job_id, b.job_id]
    assert body["metrics"] == ["train.images_per_sec", "val.loss", "val.top1"]
    missing = cli("compare", "cli-a", "no-such-job")
    assert missing.returncode == 1 and "no-such-job" in missing.stderr.strip().splitlines()[-1]
    with Client(live_server.url, user) as client:
        comparison = client.compare(["cli-b", "cli-a"], metrics=["val.top1"])
    assert [j.name for j in comparison.jobs] == ["cli-b", "cli-a"]
    assert comparison.jobs[1].metrics["val.top1"].best is not None
    assert comparison.jobs[1].metrics["val.top1"].best.value == 0.9


def test_a_new_point_changes_the_answer(client: TestClient, three: tuple[str, list[RunningJob]]) -> None:
    user, (_, b, _) = three
    params = {"ids": b.job_id, "metrics": "val.top1"}
    before = client.get("/v1/jobs/compare", params=params, headers=auth(user)).json()["jobs"][0]["metrics"]
    assert before["val.top1"]["best"]["value"] == 0.6
    # Asked again with nothing new: the same answer (from memory).
    assert (
        client.get("/v1/jobs/compare", params=params, headers=auth(user)).json()["jobs"][0]["metrics"]
        == before
    )
    assert post_report(client, b, metrics=[point("val.top1", 0.95, epoch=4, step=40)]).status_code == 200
    after = client.get("/v1/jobs/compare", params=params, headers=auth(user)).json()["jobs"][0]["metrics"]
    assert after["val.top1"]["best"] == {"value": 0.95, "epoch": 4, "step": 40}
    assert after["val.top1"]["final"]["epoch"] == 4 and after["val.top1"]["series"]["count"] == 4


def _run(
    run_id: str, name: str, rank: int = 0, params: dict[str, str] | None = None, **kw: Any
) -> dict[str, Any]:
    return {"id": run_id, "name": name, "experiment": "Default", "status": "FINISHED", "rank": rank,
            "params": params or {}, "tags": {}, **kw}  # fmt: skip


def _script(
    client: TestClient,
    settings: Settings,
    user: str,
    name: str,
    points: list[dict[str, Any]],
    runs: list[dict[str, Any]],
) -> RunningJob:
    """A script job (one node, two processes) that reported ``points`` and MLflow ``runs``
    through the worker's report route."""
    job = start_running_job(settings, client, per_node=2, user_token=user, name=name)
    make_script_job(settings, client, job)
    assert post_report(client, job, metrics=points, tracking={"runs": runs}).status_code == 200
    return job


def test_script_jobs_are_compared_by_step_or_epoch_with_their_logged_params(
    client: TestClient, settings: Settings, three: tuple[str, list[RunningJob]]
) -> None:
    user, (a, _, _) = three
    # MLflow's way: steps only (every point at epoch 0), one run.
    steps = [point("accuracy", v, epoch=0, step=s) for s, v in ((100, 0.5), (200, 0.83), (300, 0.8))]
    steps += [point("loss", 1 - v, epoch=0, step=s) for s, v in ((100, 0.5), (200, 0.83), (300, 0.8))]
    tags = {"team": "vision", "mlflow.user": "ann", "mlflow.runName": "train"}
    only = _script(
        client,
        settings,
        user,
        "mlflow-one",
        steps,
        [_run("a" * 32, "train", params={"lr": "0.1", "optimizer": "adam"}, tags=tags)],
    )
    # torchyard.run.log_metric with epochs: points over epochs 0 and 1; two runs that share a name.
    epochs = [point("accuracy", v, epoch=e, step=s) for e, s, v in ((0, 10, 0.6), (1, 20, 0.7))]
    runs = [
        _run("b" * 32, "train", 0, {"lr": "0.01"}, tags={"team": "vision"}),
        _run("c" * 32, "train", 1, {"lr": "0.02"}),
    ]
    two = _script(client, settings, user, "mlflow-two", epochs, runs)
    r = client.get(
        "/v1/jobs/compare", params={"ids": f"{a.job_id},{only.job_id},{two.job_id}"}, headers=auth(user)
    )
    assert r.status_code == 200, r.text
    body = r.json()
    train, one, both = body["jobs"]
    # A training job counts epochs; a script that reports steps only, steps; one whose points
    # span more than one epoch, epochs.
    assert [j["axis"] for j in body["jobs"]] == ["epoch", "step", "epoch"]
    assert one["metrics"]["accuracy"]["best"] == {"value": 0.83, "epoch": 0, "step": 200}
    # What each job's MLflow runs logged (not MLflow's own mlflow.* tags); with several runs,
    # each row names its run (told apart by rank where two share a name).
    assert train["logged"] == {}
    assert one["logged"] == {"mlflow: lr": "0.1", "mlflow: optimizer": "adam", "mlflow tag: team": "vision"}
    assert both["logged"] == {
        "mlflow: train (rank 0): lr": "0.01",
        "mlflow: train (rank 1): lr": "0.02",
        "mlflow tag: train (rank 0): team": "vision",
    }
    # Params before tags; the spec's own parameters stay in `differing`.
    assert body["logged_differing"] == [
        "mlflow: lr",
        "mlflow: optimizer",
        "mlflow: train (rank 0): lr",
        "mlflow: train (rank 1): lr",
        "mlflow tag: team",
        "mlflow tag: train (rank 0): team",
    ]
    assert not any(k.startswith("mlflow") for k in body["differing"])
    assert "command" in body["differing"]  # a script's spec beside a training job's

    # The CLI's text: the logged rows beside the spec's parameters, each best where it was.
    text = comparison_text(JobComparison.model_validate(body), width=400)
    rows = {line.split("  ")[0]: line.split() for line in text.splitlines()}
    assert rows["mlflow: lr"][-3:] == ["-", "0.1", "-"]
    assert rows["mlflow: optimizer"][-3:] == ["-", "adam", "-"]
    assert "0.83 (step 200)" in text and "0.7 (epoch 1)" in text and "0.9 (epoch 2)" in text
    # The same two scripts alone: of their spec only the code package differs (each its own).
    pair = client.get(
        "/v1/jobs/compare", params={"ids": f"{only.job_id},{two.job_id}"}, headers=auth(user)
    ).json()
    assert pair["differing"] == ["code"] and len(pair["logged_differing"]) == 6


def test_logged_rows_take_the_latest_attempts_runs() -> None:
    runs = [
        {**_run("a" * 32, "fit", params={"lr": "0.1"}), "attempt": 1},
        {
            **_run("b" * 32, "fit", params={"lr": "0.2"}, tags={"mlflow.note.content": "x"}),
            "attempt": 2,
        },
    ]
    # A restart's runs replace the earlier attempt's: one run, no prefix.
    assert logged_rows({"runs": runs}) == {"mlflow: lr": "0.2"}
    assert logged_rows(None) == {} and logged_rows({"params": {}, "tags": {}, "runs": []}) == {}
    # Two runs of one name and rank (a nested run): the start of their ids tells them apart.
    same = [{**_run(c * 32, "fit", params={"k": c}), "attempt": 1} for c in "de"]
    assert logged_rows({"runs": same}) == {
        "mlflow: fit (rank 0) dddddddd: k": "d",
        "mlflow: fit (rank 0) eeeeeeee: k": "e",
    }
