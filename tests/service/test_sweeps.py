"""Sweeps (docs/sweeps.md) in the app: submission and its 422s, the decisions (trials queued as
jobs with their parameters, pruning, the best trial, grid exhaustion, cancel) and their
safety when several replicas decide at once.

The trials' jobs are moved along here by writing what a worker's reports would leave in the
database (status, attempt, per-epoch metric points); tests/e2e/test_sweeps.py runs them for
real."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Job, Metric, Node, Sweep, SweepTrial
from service.db.types import utcnow
from service.services import sweep_rounds
from tests.support.factories import auth, create_token, insert_dataset, register_node, token_id


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    """The app's own reaper passes once a minute: the tests take each decision round themselves."""
    s: Settings = make_settings(reaper_interval_s=60)
    return s


@pytest.fixture
def db(settings: Settings) -> Any:
    database = Database(settings.sqlalchemy_url)
    yield database
    database.dispose()


@pytest.fixture
def user(client: TestClient, settings: Settings, db: Database) -> tuple[str, str]:
    """A user with a dataset, and a cluster that was seen (so jobs are accepted) but has no
    ready node (so the scheduler leaves the trials' jobs to the test)."""
    token = create_token(client, "user", "ann")
    worker = create_token(client, "worker")
    register_node(client, worker, "n1", units=2)
    with db.transaction() as session:
        session.execute(update(Node).values(status="lost"))
    dataset = insert_dataset(settings, token_id(client, token))
    return token, dataset


def _body(dataset: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "digits-lr",
        "job": {
            "model": {"architecture": "resnet18"},
            "train_dataset": dataset,
            "validation_dataset": dataset,
            "parameters": {"epochs": 3, "image_size": 16},
        },
        "search_space": {
            "parameters.learning_rate": {"type": "float", "low": 0.001, "high": 0.5, "log": True},
            "parameters.batch_size": {"type": "categorical", "choices": [16, 32, 64]},
        },
        "objective": {"metric": "val.top1", "goal": "maximize"},
        "algorithm": "random",
        "max_trials": 4,
        "max_concurrent_trials": 2,
        "seed": 7,
    }
    body.update(over)
    return body


def _report(db: Database, job_id: str, values: list[float], *, end: str | None = None) -> None:
    """What a worker's reports leave: the job running (one attempt), its per-epoch objective
    points, and with ``end`` the job ended so."""
    now = utcnow()
    with db.transaction() as session:
        job = session.get(Job, job_id)
        assert job is not None
        attempt = session.scalars(select(Attempt).where(Attempt.job_id == job_id)).first()
        if attempt is None:
            attempt = Attempt(job_id=job_id, number=1, status="running", master_addr="x", master_port=1)
            session.add(attempt)
            session.flush()
            job.status, job.started_at, job.scheduled_at, job.attempts_count = "running", now, now, 1
        have = {m.epoch for m in session.scalars(select(Metric).where(Metric.job_id == job_id))}
        for epoch, value in enumerate(values, start=1):
            if epoch not in have:
                session.add(
                    Metric(
                        job_id=job_id,
                        attempt_id=attempt.id,
                        attempt=1,
                        name="val.top1",
                        value=value,
                        epoch=epoch,
                        step=epoch * 10,
                        rank=0,
                        time=now,
                    )
                )
        if end is not None:
            job.status, job.finished_at = end, now
            attempt.status, attempt.finished_at = end, now
            if end == "succeeded":
                job.model_sha256 = "0" * 64
            if end == "failed":
                job.failure_code, attempt.failure_code = "RankFailedError", "RankFailedError"
                job.failure_message = "rank 0 exited with 1"


def _trial_jobs(db: Database, sweep_id: str) -> list[Job]:
    with db.read_session() as session:
        return list(session.scalars(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.trial_number)))


def _get(client: TestClient, token: str, sweep_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/sweeps/{sweep_id}", headers=auth(token))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (
            {"search_space": {"parameters.nope": {"type": "float", "low": 0.1, "high": 0.2}}},
            "search_space.parameters.nope",
            "unknown key",
        ),
        (
            {"search_space": {"parameters.learning_rate": {"type": "float", "low": 0.0, "high": 0.2}}},
            "search_space.parameters.learning_rate",
            "2.220446049250313e-16",
        ),
        (
            {"search_space": {"parameters.image_size": {"type": "int", "low": 16, "high": 2048}}},
            "search_space.parameters.image_size",
            "16..1024",
        ),
        (
            {"search_space": {"parameters.batch_size": {"type": "categorical", "choices": []}}},
            "search_space.parameters.batch_size.choices",
            "no choices",
        ),
        (
            {"search_space": {"parameters.batch_size": {"type": "float", "low": 1, "high": 8}}},
            "search_space.parameters.batch_size.type",
            "integer",
        ),
        (
            {
                "search_space": {
                    "model.architecture": {"type": "categorical", "choices": ["resnet18", "resnet-9000"]}
                }
            },
            "search_space.model.architecture",
            "resnet-9000",
        ),
        ({"max_trials": 2, "max_concurrent_trials": 3}, "max_concurrent_trials", "above max_trials"),
        ({"algorithm": "grid"}, "search_space.parameters.learning_rate.step", "grid"),
        ({"search_space": {}}, "search_space", "no keys"),
        (
            {
                "job": {
                    "model": {"architecture": "resnet18"},
                    "train_dataset": "x",
                    "validation_dataset": "x",
                    "parameters": {"epochz": 1},
                }
            },
            "job.parameters.epochz",
            "unknown field",
        ),
    ],
)
def test_bad_search_spaces_are_422_naming_the_field_and_store_nothing(
    client: TestClient, user: tuple[str, str], db: Database, change: dict[str, Any], field: str, words: str
) -> None:
    token, dataset = user
    r = client.post("/v1/sweeps", json=_body(dataset, **change), headers=auth(token))
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["details"]["field"] == field, body
    assert words in body["message"], body
    with db.read_session() as session:
        assert session.scalars(select(Sweep)).first() is None
        assert session.scalars(select(Job)).first() is None


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("parameters.epoch", "parameters.epochs"),
        ("parameters.learningrate", "parameters.learning_rate"),
        ("paramters.batch_size", "parameters.batch_size"),
        ("resources.node_cont", "resources.node_count"),
    ],
)
def test_an_unknown_search_space_key_names_the_key_it_most_likely_means(
    client: TestClient, user: tuple[str, str], key: str, suggestion: str
) -> None:
    token, dataset = user
    space = {key: {"type": "int", "low": 1, "high": 2}}
    r = client.post("/v1/sweeps", json=_body(dataset, search_space=space), headers=auth(token))
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["details"]["field"] == f"search_space.{key}"
    assert body["details"]["suggestion"] == suggestion
    assert f"unknown key {key!r}" in body["message"] and f"did you mean {suggestion!r}?" in body["message"]
    # An unknown field of the sweep's job: the field of the job it most likely means.
    job = _body(dataset)["job"]
    job["parameters"] = {"epoch": 2}
    r = client.post("/v1/sweeps", json=_body(dataset, job=job), headers=auth(token))
    assert r.status_code == 422, r.text
    details = r.json()["details"]
    assert details["field"] == "job.parameters.epoch" and details["suggestion"] == "job.parameters.epochs"
    assert details["message"] == "unknown field 'job.parameters.epoch': did you mean 'job.parameters.epochs'?"


def test_unknown_dataset_is_a_404_and_stores_nothing(
    client: TestClient, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    body = _body(dataset)
    body["job"]["train_dataset"] = "nosuchdataset"
    r = client.post("/v1/sweeps", json=body, headers=auth(token))
    assert r.status_code == 404, r.text
    with db.read_session() as session:
        assert session.scalars(select(Sweep)).first() is None


def test_random_sweep_runs_its_trials_as_jobs_and_names_the_best(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    r = client.post("/v1/sweeps", json=_body(dataset), headers=auth(token))
    assert r.status_code == 201, r.text
    sweep = r.json()
    assert sweep["status"] == "running" and sweep["algorithm"] == "random"
    # max_concurrent_trials jobs are queued at once, each an ordinary job with its parameters.
    jobs = _trial_jobs(db, sweep["id"])
    assert [j.trial_number for j in jobs] == [0, 1]
    shown = {t["number"]: t for t in sweep["trials"]}
    for job in jobs:
        params = shown[job.trial_number]["params"]
        assert job.spec["parameters"]["learning_rate"] == params["parameters.learning_rate"]
        assert job.spec["parameters"]["batch_size"] == params["parameters.batch_size"]
        assert job.spec["parameters"]["epochs"] == 3 and job.status == "queued"
        assert 0.001 <= params["parameters.learning_rate"] <= 0.5
        public = client.get(f"/v1/jobs/{job.id}", headers=auth(token)).json()
        assert public["sweep_id"] == sweep["id"] and public["trial_number"] == job.trial_number
    # No trial has completed: no importances yet, and the reason.
    early = client.get(f"/v1/sweeps/{sweep['id']}/importance", headers=auth(token)).json()
    assert early["completed"] == 0 and early["importances"] is None
    assert "2 completed trials are needed" in early["message"]
    values = {0: [0.3, 0.6, 0.5], 1: [0.2, 0.4, 0.45], 2: [0.5, 0.7, 0.8], 3: [0.1, 0.2, 0.3]}
    for number in range(4):
        sweep_rounds.drive(db, settings)
        job = next(j for j in _trial_jobs(db, sweep["id"]) if j.trial_number == number)
        _report(db, job.id, values[number], end="succeeded")
    for _ in range(3):
        sweep_rounds.drive(db, settings)
    done = _get(client, token, sweep["id"])
    assert done["status"] == "succeeded"
    assert len(done["trials"]) == 4 and {t["state"] for t in done["trials"]} == {"completed"}
    # A trial's value is its best over epochs; the best trial holds the largest.
    assert [t["value"] for t in done["trials"]] == [0.6, 0.45, 0.8, 0.3]
    assert done["best_trial"]["number"] == 2 and done["best_trial"]["value"] == 0.8
    assert done["epochs_run"] == 12
    assert done["trials"][2]["intermediate"] == {"1": 0.5, "2": 0.7, "3": 0.8}
    # Trial numbers were given once each; the listing shows the sweep without its trials.
    assert len(_trial_jobs(db, sweep["id"])) == 4
    listed = client.get("/v1/sweeps", headers=auth(token)).json()["items"]
    assert [s["id"] for s in listed] == [sweep["id"]] and listed[0]["trials"] is None
    assert listed[0]["trial_counts"] == {"completed": 4}
    # By name or id prefix too; another user sees nothing.
    assert _get(client, token, "digits-lr")["id"] == sweep["id"]
    other = create_token(client, "user", "bob")
    assert client.get(f"/v1/sweeps/{sweep['id']}", headers=auth(other)).status_code == 404
    # Each key's importance for the objective (Optuna's, over the completed trials),
    # largest first, together 1; asked again, the same answer.
    r = client.get("/v1/sweeps/digits-lr/importance", headers=auth(token))
    assert r.status_code == 200, r.text
    found = r.json()
    assert found["sweep_id"] == sweep["id"] and found["completed"] == 4 and found["message"] is None
    assert found["objective"] == {"metric": "val.top1", "goal": "maximize"}
    shares = found["importances"]
    assert set(shares) == {"parameters.learning_rate", "parameters.batch_size"}
    assert abs(sum(shares.values()) - 1) < 1e-6 and all(v >= 0 for v in shares.values())
    assert list(shares.values()) == sorted(shares.values(), reverse=True)
    assert client.get(f"/v1/sweeps/{sweep['id']}/importance", headers=auth(token)).json() == found
    assert client.get(f"/v1/sweeps/{sweep['id']}/importance", headers=auth(other)).status_code == 404


def test_asha_prunes_a_trial_below_the_rung_and_cancels_its_job(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    body = _body(
        dataset,
        early_stopping={"type": "asha", "min_epochs": 1, "reduction_factor": 2},
        max_concurrent_trials=2,
    )
    sweep = client.post("/v1/sweeps", json=body, headers=auth(token)).json()
    good, bad = _trial_jobs(db, sweep["id"])
    _report(db, good.id, [0.9])
    sweep_rounds.drive(db, settings)
    _report(db, bad.id, [0.1])
    result = sweep_rounds.drive(db, settings)
    assert result.pruned == [bad.id]
    shown = _get(client, token, sweep["id"])
    trial = shown["trials"][1]
    assert trial["state"] == "pruned" and trial["epochs"] == 1 and trial["value"] == 0.1
    assert trial["reason"] == "pruned by ASHA at epoch 1: val.top1 0.1 below the rung's top half"
    job = client.get(f"/v1/jobs/{bad.id}", headers=auth(token)).json()
    assert job["status"] in ("cancelling", "cancelled")
    assert job["cancel_reason"] == trial["reason"]
    # The good trial goes on; a third trial took the pruned one's place.
    assert shown["trials"][0]["state"] == "running"
    assert [t["number"] for t in shown["trials"]] == [0, 1, 2]


def test_median_rule_prunes_with_the_median_in_its_reason(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    body = _body(dataset, early_stopping={"type": "median", "min_epochs": 1, "min_trials": 1})
    sweep = client.post("/v1/sweeps", json=body, headers=auth(token)).json()
    first, second = _trial_jobs(db, sweep["id"])
    _report(db, first.id, [0.5, 0.6, 0.7], end="succeeded")
    sweep_rounds.drive(db, settings)
    _report(db, second.id, [0.2])
    sweep_rounds.drive(db, settings)
    trial = _get(client, token, sweep["id"])["trials"][1]
    assert trial["state"] == "pruned"
    assert trial["reason"] == (
        "pruned by the median rule at epoch 1: val.top1 0.2 below the median 0.5 of the other trials at that epoch"
    )


def test_grid_sweep_visits_each_point_once_and_ends(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    body = _body(
        dataset,
        algorithm="grid",
        max_trials=10,
        max_concurrent_trials=3,
        search_space={
            "parameters.learning_rate": {"type": "float", "low": 0.01, "high": 0.03, "step": 0.01},
            "parameters.batch_size": {"type": "categorical", "choices": [16, 32]},
        },
    )
    sweep = client.post("/v1/sweeps", json=body, headers=auth(token)).json()
    for _ in range(10):
        for job in _trial_jobs(db, sweep["id"]):
            if job.status == "queued":
                _report(db, job.id, [0.5], end="succeeded")
        sweep_rounds.drive(db, settings)
    done = _get(client, token, sweep["id"])
    assert done["status"] == "succeeded"
    points = sorted(
        (t["params"]["parameters.learning_rate"], t["params"]["parameters.batch_size"])
        for t in done["trials"]
    )
    assert points == [(lr, bs) for lr in (0.01, 0.02, 0.03) for bs in (16, 32)]


@pytest.mark.parametrize(
    ("space", "field", "words"),
    [
        # 10^12 integers: counted, never listed.
        (
            {"parameters.random_seed": {"type": "int", "low": 0, "high": 10**12 - 1}},
            "search_space.parameters.random_seed",
            "1000000000000 values: more than a grid may hold",
        ),
        (
            {"parameters.random_seed": {"type": "int", "low": -(2**63), "high": 2**63 - 1, "step": 3}},
            "search_space.parameters.random_seed",
            f"{(2**64 - 1) // 3 + 1} values",
        ),
        # So many floats that their count is not a finite number.
        (
            {"parameters.learning_rate": {"type": "float", "low": 0.001, "high": 1e308, "step": 1e-300}},
            "search_space.parameters.learning_rate.step",
            "more than a grid may hold",
        ),
        # Axes each small enough, their product not.
        (
            {
                "parameters.random_seed": {"type": "int", "low": 1, "high": 10_000},
                "parameters.patience": {"type": "int", "low": 1, "high": 10_000},
                "parameters.print_frequency": {"type": "int", "low": 1, "high": 10_000},
            },
            "search_space",
            "the grid has 1000000000000 points",
        ),
    ],
)
def test_a_grid_too_large_is_a_422_naming_the_key_and_its_count(
    client: TestClient, user: tuple[str, str], db: Database, space: dict[str, Any], field: str, words: str
) -> None:
    """The points are counted before any is listed: a grid of 10^12 is refused at once."""
    token, dataset = user
    body = _body(dataset, algorithm="grid", search_space=space)
    r = client.post("/v1/sweeps", json=body, headers=auth(token))
    assert r.status_code == 422, r.text
    assert r.json()["details"]["field"] == field, r.json()
    assert words in r.json()["message"], r.json()
    with db.read_session() as session:
        assert session.scalars(select(Sweep)).first() is None


def test_trials_reaching_a_rung_in_one_round_are_judged_best_first(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    """Four trials report epoch 1 between two decision rounds: ASHA (top half) keeps the best
    of them, not every one that happens to stand best when judged in trial-number order."""
    token, dataset = user
    body = _body(
        dataset,
        early_stopping={"type": "asha", "min_epochs": 1, "reduction_factor": 2},
        max_trials=4,
        max_concurrent_trials=4,
    )
    sweep = client.post("/v1/sweeps", json=body, headers=auth(token)).json()
    jobs = _trial_jobs(db, sweep["id"])
    for job, value in zip(jobs, [0.2, 0.3, 0.9, 0.1], strict=True):
        _report(db, job.id, [value])
    result = sweep_rounds.drive(db, settings)
    assert sorted(result.pruned) == sorted([jobs[0].id, jobs[1].id, jobs[3].id])
    states = [t["state"] for t in _get(client, token, sweep["id"])["trials"]]
    assert states == ["pruned", "pruned", "running", "pruned"]


@pytest.mark.parametrize("algorithm", ["random", "tpe"])
def test_no_two_trials_get_the_same_parameters_while_new_ones_are_left(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database, algorithm: str
) -> None:
    """A trial with the parameters of an earlier one would train the same curve again: each
    trial gets parameters no trial had, until the space has none left."""
    token, dataset = user
    body = _body(
        dataset,
        algorithm=algorithm,
        search_space={
            "parameters.learning_rate": {"type": "categorical", "choices": [0.001, 0.01, 0.1, 1.0]}
        },
        max_trials=6,
        max_concurrent_trials=2,
    )
    sweep = client.post("/v1/sweeps", json=body, headers=auth(token)).json()
    values = {0.001: 0.2, 0.01: 0.5, 0.1: 0.9, 1.0: 0.1}
    for _ in range(8):
        for job in _trial_jobs(db, sweep["id"]):
            if job.status == "queued":
                _report(db, job.id, [values[job.spec["parameters"]["learning_rate"]]], end="succeeded")
        sweep_rounds.drive(db, settings)
    done = _get(client, token, sweep["id"])
    assert done["status"] == "succeeded" and len(done["trials"]) == 6
    rates = [t["params"]["parameters.learning_rate"] for t in done["trials"]]
    assert sorted(rates[:4]) == [0.001, 0.01, 0.1, 1.0]  # all four before any comes again
    assert set(rates[4:]) <= set(values)


def test_cancel_stops_every_trial_and_asks_for_no_more(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    sweep = client.post("/v1/sweeps", json=_body(dataset), headers=auth(token)).json()
    running, queued = _trial_jobs(db, sweep["id"])
    _report(db, running.id, [0.4])
    r = client.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=auth(token))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    assert {t["state"] for t in r.json()["trials"]} == {"cancelled"}
    jobs = {j.id: j for j in _trial_jobs(db, sweep["id"])}
    assert jobs[queued.id].status == "cancelled"
    assert jobs[running.id].status in ("cancelling", "cancelled")
    assert jobs[running.id].cancel_reason == "sweep digits-lr cancelled by ann"
    sweep_rounds.drive(db, settings)
    assert len(_trial_jobs(db, sweep["id"])) == 2
    # Idempotent.
    assert (
        client.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=auth(token)).json()["status"] == "cancelled"
    )


def test_script_sweep_expands_command_args(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    files = {"file": ("code.tar.gz", _code_archive(), "application/gzip")}
    code = client.post("/v1/code", files=files, headers=auth(token))
    assert code.status_code == 201, code.text
    job = {
        "type": "script",
        "code": code.json()["id"],
        "command": ["python", "train.py", "--lr", "$LR", "--depth=${DEPTH}"],
    }
    space = {
        "command_args.LR": {"type": "float", "low": 0.01, "high": 0.1},
        "command_args.DEPTH": {"type": "categorical", "choices": [2, 4]},
    }
    r = client.post("/v1/sweeps", json=_body(dataset, job=job, search_space=space), headers=auth(token))
    assert r.status_code == 201, r.text
    for trial_job in _trial_jobs(db, r.json()["id"]):
        trial = next(t for t in r.json()["trials"] if t["job_id"] == trial_job.id)
        lr, depth = trial["params"]["command_args.LR"], trial["params"]["command_args.DEPTH"]
        assert trial_job.spec["command"] == ["python", "train.py", "--lr", str(lr), f"--depth={depth}"]
    space["command_args.MISSING"] = {"type": "categorical", "choices": [1]}
    r = client.post("/v1/sweeps", json=_body(dataset, job=job, search_space=space), headers=auth(token))
    assert r.status_code == 422 and r.json()["details"]["field"] == "search_space.command_args.MISSING"


def _code_archive() -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"print('hi')\n"
        info = tarfile.TarInfo("train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.both_databases
def test_replicas_deciding_at_once_never_give_a_trial_number_twice(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    body = _body(dataset, max_trials=12, max_concurrent_trials=4, algorithm="tpe")
    sweep = client.post("/v1/sweeps", json=body, headers=auth(token)).json()
    errors: list[BaseException] = []

    def replica() -> None:
        own = Database(settings.sqlalchemy_url)
        try:
            for _ in range(2):
                sweep_rounds.drive(own, settings)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            own.dispose()

    for _ in range(3):
        # Every live trial ends; four replicas then decide at once what comes next.
        for job in _trial_jobs(db, sweep["id"]):
            if job.status == "queued":
                _report(db, job.id, [0.5], end="succeeded")
        threads = [threading.Thread(target=replica) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    with db.read_session() as session:
        numbers = session.scalars(select(SweepTrial.number).where(SweepTrial.sweep_id == sweep["id"])).all()
        jobs = session.scalars(select(Job.trial_number).where(Job.sweep_id == sweep["id"])).all()
    assert sorted(numbers) == list(range(12)) and sorted(jobs) == list(range(12))


def test_a_trial_that_cannot_be_queued_fails_the_sweep_saying_why(
    client: TestClient, settings: Settings, user: tuple[str, str], db: Database
) -> None:
    token, dataset = user
    sweep = client.post("/v1/sweeps", json=_body(dataset), headers=auth(token)).json()
    for job in _trial_jobs(db, sweep["id"]):
        _report(db, job.id, [0.5], end="succeeded")
    # Between trials nothing uses the dataset: its owner may delete it.
    assert client.delete(f"/v1/datasets/{dataset}", headers=auth(token)).status_code == 204
    sweep_rounds.drive(db, settings)
    failed = _get(client, token, sweep["id"])
    assert failed["status"] == "failed"
    assert failed["message"].startswith("trial 2 could not be queued: ")
    assert dataset in failed["message"] and len(failed["trials"]) == 2
