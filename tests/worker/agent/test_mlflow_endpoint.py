"""The MLflow tracking endpoint of a script placement (docs/script-jobs.md), driven by the real MLflow
client (``mlflow-skinny``) in a process of its own, and by plain HTTP for what a client
would never send: bad and huge requests, missing or foreign tokens, another job's runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from worker.agent.mlflow_endpoint import TRACKING_FILE, TrackingEndpoint
from worker.agent.run_files import RunFileReader

pytest.importorskip("mlflow")

CLIENT_SCRIPT = """
import pathlib, mlflow
mlflow.set_experiment("digits")
with mlflow.start_run(run_name="first") as run:
    mlflow.log_params({"lr": 0.1, "batch_size": 32})
    mlflow.set_tag("team", "vision")
    mlflow.log_metric("loss", 1.5)          # no step: MLflow sends step 0 each time
    mlflow.log_metric("loss", 1.25)
    mlflow.log_metric("val acc", 0.75, step=3)
    mlflow.log_metrics({"a": 1.0, "b": float("nan")}, step=2)
    notes = pathlib.Path("notes.txt")
    notes.write_text("kept")
    mlflow.log_artifact(str(notes))
    client = mlflow.MlflowClient()
    history = client.get_metric_history(run.info.run_id, "loss")
    print("HISTORY", sorted((m.step, m.value) for m in history))
    print("PARAMS", sorted(client.get_run(run.info.run_id).data.params.items()))
    try:
        mlflow.log_param("lr", 0.2)
    except Exception as exc:
        print("CHANGED", type(exc).__name__, "INVALID_PARAMETER_VALUE" in str(exc))
"""


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[TrackingEndpoint]:
    run_dir = tmp_path / "run"
    (run_dir / "outputs").mkdir(parents=True)
    ep = TrackingEndpoint(run_dir, run_dir / "outputs", node_rank=0)
    ep.start()
    try:
        yield ep
    finally:
        ep.stop()


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_mlflow_client_logs_metrics_params_tags_and_artifacts(
    endpoint: TrackingEndpoint, tmp_path: Path
) -> None:
    run_dir = endpoint.store.state_dir
    env = {**os.environ, **endpoint.env_for(3, "rank-3")}
    done = subprocess.run(
        [sys.executable, "-c", CLIENT_SCRIPT],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "HISTORY [(0, 1.25), (0, 1.5)]" in done.stdout  # MLflow's own view of the run
    assert "PARAMS [('batch_size', '32'), ('lr', '0.1')]" in done.stdout
    assert "CHANGED MlflowException True" in done.stdout  # a param's value is fixed once logged
    # Each point is a line of the process's metrics file, with its rank; the repeated step 0
    # takes the next step, a space in a name becomes "_", NaN stays out of the job's metrics.
    points = [
        (p["name"], p["value"], p["step"], p["rank"])
        for p in _lines(run_dir / "metrics" / "mlflow-rank-3.jsonl")
    ]
    assert points == [("loss", 1.5, 0, 3), ("loss", 1.25, 1, 3), ("val_acc", 0.75, 3, 3), ("a", 1.0, 2, 3)]
    tracking = json.loads((run_dir / TRACKING_FILE).read_text())
    (run,) = tracking["runs"]
    assert (run["name"], run["experiment"], run["status"], run["rank"]) == ("first", "digits", "FINISHED", 3)
    assert run["params"] == {"lr": "0.1", "batch_size": "32"} and run["tags"]["team"] == "vision"
    artifact = run_dir / "outputs" / "mlflow" / run["id"] / "artifacts" / "notes.txt"
    assert artifact.read_text() == "kept"  # in the outputs the job keeps
    # The reporter sends the runs whole, once per change.
    agent_log = tmp_path / "agent.log"
    agent_log.write_text("")
    reader = RunFileReader(
        "j", run_dir, list, agent_log, "n", lambda: sorted((run_dir / "metrics").glob("*.jsonl")),
        tracking_source=lambda: (run_dir / TRACKING_FILE).read_bytes(),
    )  # fmt: skip
    batch = reader.collect(final=False)
    assert batch.payload()["tracking"] == tracking and len(batch.metrics) == 4
    assert reader.collect(final=False).tracking is None


def _call(ep: TrackingEndpoint, method: str, call: str, token: str | None, **kw: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"{ep.uri}/api/2.0/mlflow/{call}", headers=headers, timeout=10, **kw)  # type: ignore[arg-type]


def test_bad_huge_and_foreign_requests_get_mlflow_errors_and_change_nothing(
    endpoint: TrackingEndpoint, tmp_path: Path
) -> None:
    other_dir = tmp_path / "other"
    (other_dir / "outputs").mkdir(parents=True)
    other = TrackingEndpoint(other_dir, other_dir / "outputs", node_rank=0)  # another job's
    other.start()
    try:
        mine = endpoint.env_for(0, "rank-0")["MLFLOW_TRACKING_TOKEN"]
        theirs = other.env_for(0, "rank-0")["MLFLOW_TRACKING_TOKEN"]
        r = _call(other, "POST", "runs/create", theirs, json={"experiment_id": "0"})
        assert r.status_code == 200, r.text
        their_run = r.json()["run"]["info"]["run_id"]
        r = _call(endpoint, "POST", "runs/create", mine, json={"experiment_id": "0", "run_name": "mine"})
        my_run = r.json()["run"]["info"]["run_id"]

        def refused(r: httpx.Response, status: int, code: str, words: str) -> None:
            assert r.status_code == status, r.text
            body = r.json()
            assert body["error_code"] == code and words in body["message"], body

        # No token, or another job's token: this job's endpoint does not answer.
        refused(
            _call(endpoint, "GET", "runs/get", None, params={"run_id": my_run}),
            401,
            "UNAUTHENTICATED",
            "token",
        )
        refused(
            _call(endpoint, "GET", "runs/get", theirs, params={"run_id": my_run}),
            401,
            "UNAUTHENTICATED",
            "token",
        )
        # With its own token, another job's run is unknown here: neither read nor written.
        refused(
            _call(endpoint, "GET", "runs/get", mine, params={"run_id": their_run}),
            404,
            "RESOURCE_DOES_NOT_EXIST",
            their_run,
        )
        refused(
            _call(
                endpoint, "POST", "runs/log-metric", mine, json={"run_id": their_run, "key": "x", "value": 1}
            ),
            404,
            "RESOURCE_DOES_NOT_EXIST",
            their_run,
        )
        # Bad input: the field is named, MLflow's error format, 4xx.
        refused(
            _call(endpoint, "POST", "runs/log-metric", mine, content=b"{not json"),
            400,
            "MALFORMED_REQUEST",
            "JSON",
        )
        refused(
            _call(
                endpoint,
                "POST",
                "runs/log-metric",
                mine,
                json={"run_id": my_run, "key": "x", "value": "high"},
            ),
            400,
            "INVALID_PARAMETER_VALUE",
            "'x'",
        )
        refused(
            _call(
                endpoint,
                "POST",
                "runs/log-metric",
                mine,
                json={"run_id": my_run, "key": "x", "value": 1, "step": -1},
            ),
            400,
            "INVALID_PARAMETER_VALUE",
            "step",
        )
        refused(
            _call(
                endpoint, "POST", "runs/log-metric", mine, json={"run_id": my_run, "key": "?bad", "value": 1}
            ),
            400,
            "INVALID_PARAMETER_VALUE",
            "?bad",
        )
        many = [{"key": "m", "value": 1.0, "timestamp": 0, "step": i} for i in range(1001)]
        refused(
            _call(endpoint, "POST", "runs/log-batch", mine, json={"run_id": my_run, "metrics": many}),
            400,
            "INVALID_PARAMETER_VALUE",
            "1000",
        )
        refused(
            _call(
                endpoint,
                "POST",
                "runs/set-tag",
                mine,
                json={"run_id": my_run, "key": "k", "value": "v" * 9000},
            ),
            400,
            "INVALID_PARAMETER_VALUE",
            "'k'",
        )
        huge = b'{"run_id": "' + b"x" * (5 << 20) + b'"}'
        refused(
            _call(endpoint, "POST", "runs/log-batch", mine, content=huge),
            413,
            "INVALID_PARAMETER_VALUE",
            "bytes",
        )
        refused(
            _call(endpoint, "POST", "runs/search-everything", mine, json={}),
            404,
            "ENDPOINT_NOT_FOUND",
            "search",
        )
        # A batch with one bad metric stores none of it.
        mixed = [{"key": "good", "value": 1.0, "timestamp": 0, "step": 0}, {"key": "bad", "value": None}]
        refused(
            _call(endpoint, "POST", "runs/log-batch", mine, json={"run_id": my_run, "metrics": mixed}),
            400, "INVALID_PARAMETER_VALUE", "'bad'",
        )  # fmt: skip
        assert not (endpoint.store.state_dir / "metrics" / "mlflow-rank-0.jsonl").exists()
        # The endpoint still answers after all that.
        ok = _call(endpoint, "POST", "runs/log-metric", mine, json={"run_id": my_run, "key": "x", "value": 2})
        assert ok.status_code == 200 and ok.json() == {}
        assert [p["name"] for p in _lines(endpoint.store.state_dir / "metrics" / "mlflow-rank-0.jsonl")] == [
            "x"
        ]
    finally:
        other.stop()


PER_NODE_SCRIPT = """
import os, mlflow
rank = int(os.environ["RANK"])
with mlflow.start_run(run_name=f"rank{rank}"):
    for step in range(3):
        mlflow.log_metric("loss", 10 * rank + step, step=step)
    mlflow.log_metric("again", 1.0)  # no step: 0, then the next one above, per rank
    mlflow.log_metric("again", 2.0)
"""


def test_per_node_ranks_started_by_torchrun_log_with_their_own_rank(
    endpoint: TrackingEndpoint, tmp_path: Path
) -> None:
    """``per_node``: the node's one command is ``torchrun``, its two ranks inherit the node's
    token, and each point carries the rank of the process that logged it (its ``RANK``);
    a process with no ``RANK`` (the command itself) logs as the node's first rank."""
    env = {**os.environ, **endpoint.env_for(4, "node-2", ranks_from_caller=True)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    (tmp_path / "log.py").write_text(PER_NODE_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*torchrun, "log.py"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # This test's own process has no RANK.
    assert "RANK" not in os.environ
    token = env["MLFLOW_TRACKING_TOKEN"]
    r = _call(endpoint, "POST", "runs/create", token, json={"experiment_id": "0", "run_name": "node"})
    run_id = r.json()["run"]["info"]["run_id"]
    r = _call(endpoint, "POST", "runs/log-metric", token, json={"run_id": run_id, "key": "loss", "value": 99})
    assert r.status_code == 200, r.text
    points = _lines(endpoint.store.state_dir / "metrics" / "mlflow-node-2.jsonl")
    by_rank = {
        rank: sorted((str(p["name"]), p["step"], p["value"]) for p in points if p["rank"] == rank)
        for rank in sorted({int(str(p["rank"])) for p in points})
    }
    assert sorted(by_rank) == [0, 1, 4]
    for rank in (0, 1):
        # Each rank's steps are its own: neither rank's step 0 pushes the other's on.
        assert by_rank[rank] == [
            ("again", 0, 1.0), ("again", 1, 2.0),
            ("loss", 0, 10.0 * rank), ("loss", 1, 10.0 * rank + 1), ("loss", 2, 10.0 * rank + 2),
        ]  # fmt: skip
    assert by_rank[4] == [("loss", 0, 99.0)]
    runs = json.loads((endpoint.store.state_dir / TRACKING_FILE).read_text())["runs"]
    assert sorted((r["name"], r["rank"]) for r in runs) == [("node", 4), ("rank0", 0), ("rank1", 1)]


def test_ranks_creating_one_experiment_at_once_all_get_it(endpoint: TrackingEndpoint) -> None:
    """Two ranks call ``mlflow.set_experiment("digits")`` at the same moment: both creates
    give the same experiment (MLflow's client, told RESOURCE_ALREADY_EXISTS, would leave the
    loser's runs in the Default experiment), and the name is found by either."""
    token = endpoint.env_for(0, "rank-0")["MLFLOW_TRACKING_TOKEN"]
    ids = [
        _call(endpoint, "POST", "experiments/create", token, json={"name": "digits"}).json()["experiment_id"]
        for _ in range(2)
    ]
    assert ids[0] == ids[1] != "0"
    found = _call(endpoint, "GET", "experiments/get-by-name", token, params={"experiment_name": "digits"})
    assert found.json()["experiment"]["experiment_id"] == ids[0]
