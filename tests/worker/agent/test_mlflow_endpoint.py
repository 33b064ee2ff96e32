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
from fastapi.testclient import TestClient

from service.config import Settings
from tests.support.report_helpers import all_metrics, post_report, start_running_job
from worker.agent.mlflow_endpoint.server import TrackingEndpoint
from worker.agent.mlflow_endpoint.store import TRACKING_FILE
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
    # (MLflow's client sends it for a call without a step) is kept, as MLflow's history keeps
    # it, the second value there being occurrence 1; a space in a name becomes "_", NaN stays
    # out of the job's metrics.
    points = [
        (p["name"], p["value"], p["step"], p.get("occurrence", 0), p["rank"])
        for p in _lines(run_dir / "metrics" / "mlflow-rank-3.jsonl")
    ]
    assert points == [
        ("loss", 1.5, 0, 0, 3), ("loss", 1.25, 0, 1, 3), ("val_acc", 0.75, 3, 0, 3), ("a", 1.0, 2, 0, 3)
    ]  # fmt: skip
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


SAME_STEP_SCRIPT = """
import mlflow
with mlflow.start_run():
    mlflow.log_metric("loss", 0.5, step=5)
    mlflow.log_metric("loss", 0.25, step=5)  # as Lightning's epoch at an epoch's last step
    mlflow.log_metric("loss", 0.125, step=6)
    mlflow.log_metric("lr", 0.1, step=2)
"""


def test_values_logged_at_one_step_keep_their_steps_and_reach_the_api_once(
    endpoint: TrackingEndpoint, tmp_path: Path, client: TestClient, settings: Settings
) -> None:
    """The same metric logged twice at step 5, then at 6: the points are (5, v1), (5, v2),
    (6, v3) at the job's metrics API (no step moved), however often the report is sent. A
    call without a step (a hand-made request: MLflow's client always sends one) takes the
    next step above the highest."""
    state = endpoint.store.state_dir
    env = {**os.environ, **endpoint.env_for(0, "rank-0")}
    done = subprocess.run(
        [sys.executable, "-c", SAME_STEP_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    token = env["MLFLOW_TRACKING_TOKEN"]
    run_id = _call(endpoint, "POST", "runs/create", token, json={"experiment_id": "0"}).json()["run"]["info"]
    for value in (1.0, 2.0):
        r = _call(endpoint, "POST", "runs/log-metric", token,
                  json={"run_id": run_id["run_id"], "key": "lr", "value": value})  # fmt: skip
        assert r.status_code == 200, r.text
    agent_log = tmp_path / "agent.log"
    agent_log.write_text("")
    reader = RunFileReader(
        "j", state, list, agent_log, "n", lambda: sorted((state / "metrics").glob("*.jsonl"))
    )
    payload = reader.collect(final=False).payload()
    job = start_running_job(settings, client, per_node=1)
    for _ in range(2):  # the reporter's retry of a batch the API stored
        r = post_report(client, job, metrics=payload["metrics"])
        assert r.status_code == 200, r.text
    assert r.json()["metrics"] == 0 and r.json()["metrics_duplicate"] == 6
    points = [(p["name"], p["step"], p["value"]) for p in all_metrics(client, job)]
    assert points == [
        ("loss", 5, 0.5), ("loss", 5, 0.25), ("loss", 6, 0.125), ("lr", 2, 0.1), ("lr", 3, 1.0), ("lr", 4, 2.0)
    ]  # fmt: skip


LOGGED_MODEL_SCRIPT = """
import importlib.machinery, os, pathlib, sys, types

# Model.log imports pandas (for input examples, unused here) and nothing else of it on this
# path: a stand-in module lets mlflow-skinny run it; the REST calls are the real client's.
pandas = types.ModuleType("pandas")
pandas.DataFrame, pandas.Series = type("DataFrame", (), {}), type("Series", (), {})
pandas.__version__, pandas.__spec__ = "2.2.0", importlib.machinery.ModuleSpec("pandas", None)
sys.modules.setdefault("pandas", pandas)
import mlflow
from mlflow.models import Model

client = mlflow.MlflowClient()
with mlflow.start_run() as run:
    mlflow.log_params({"lr": 0.1})
    mlflow.log_metric("acc", 0.5, step=0)
    model = mlflow.initialize_logged_model(name="net", tags={"team": "vision"}, params={"depth": "3"})
    print("CREATED", model.status, model.source_run_id == run.info.run_id)
    folder = pathlib.Path("weights")
    folder.mkdir()
    (folder / "w.txt").write_text("weights")
    client.log_model_artifacts(model.model_id, str(folder))  # copied by the client itself
    client.set_logged_model_tags(model.model_id, {"stage": "dev"})
    client.log_model_params(model.model_id, {"width": "8"})
    model = client.finalize_logged_model(model.model_id, "READY")
    print("FINAL", model.status, sorted(model.params.items()), model.tags["stage"])
    print("GOT", client.get_logged_model(model.model_id).name)

    def save_model(path, mlflow_model, **kwargs):  # the least a flavor does
        os.makedirs(path)
        pathlib.Path(path, "model.bin").write_text("tiny")
        mlflow_model.add_flavor("tiny", data="model.bin")
        mlflow_model.save(os.path.join(path, "MLmodel"))

    flavor = types.ModuleType("tiny")
    flavor.save_model = save_model
    info = Model.log(artifact_path=None, name="tiny", flavor=flavor)  # what mlflow.pytorch.log_model runs
    tiny = client.get_logged_model(info.model_id)
    print("TINY", tiny.status, [(m.key, m.value, m.step) for m in tiny.metrics])
    print("HISTORY", [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "acc")])
    found = client.search_logged_models([run.info.experiment_id], filter_string="name = 'net'")
    print("SEARCH", [m.name for m in found])
    found = client.search_logged_models(
        [run.info.experiment_id], filter_string="name LIKE '%n%'",
        order_by=[{"field_name": "name", "ascending": False}],
    )
    print("SEARCH2", [m.name for m in found])
    found = client.search_logged_models(
        [run.info.experiment_id], filter_string="params.lr = '0.1' AND metrics.acc >= 0.5"
    )
    print("SEARCH3", [m.name for m in found])
    print("OUTPUTS", [o.model_id == info.model_id for o in client.get_run(run.info.run_id).outputs.model_outputs])
"""


def test_logged_models_of_mlflow_3_land_in_the_outputs_and_the_jobs_tracking(
    endpoint: TrackingEndpoint, tmp_path: Path
) -> None:
    """MLflow 3's logged models through the real client: ``initialize_logged_model``, files
    logged into it, its tags and params, ``finalize_logged_model``, get and search, and
    ``Model.log`` (what ``mlflow.pytorch.log_model`` and the other flavors run) with a flavor
    of its own. The files are in the node's outputs (``mlflow/models/<id>/artifacts``), the
    models in ``tracking.json``; ``log_model`` logging the run's metrics again for the model
    adds no point to the job's metrics."""
    state = endpoint.store.state_dir
    env = {**os.environ, **endpoint.env_for(0, "rank-0")}
    done = subprocess.run(
        [sys.executable, "-c", LOGGED_MODEL_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "CREATED PENDING True" in out
    assert "FINAL READY [('depth', '3'), ('width', '8')] dev" in out and "GOT net" in out
    assert "TINY READY [('acc', 0.5, 0)]" in out  # the run's metric at the model's step
    assert "HISTORY [(0, 0.5)]" in out and "OUTPUTS [True]" in out
    assert "SEARCH ['net']" in out and "SEARCH2 ['tiny', 'net']" in out and "SEARCH3 ['tiny']" in out
    assert [p["name"] for p in _lines(state / "metrics" / "mlflow-rank-0.jsonl")] == ["acc"]
    tracking = json.loads((state / TRACKING_FILE).read_text())
    models = {m["name"]: m for m in tracking["models"]}
    (run,) = tracking["runs"]
    net, tiny = models["net"], models["tiny"]
    assert (net["status"], net["run"], net["rank"], net["experiment"]) == ("READY", run["id"], 0, "Default")
    assert net["params"] == {"depth": "3", "width": "8"}
    assert net["tags"]["team"] == "vision" and net["tags"]["stage"] == "dev"
    outputs = endpoint.store.outputs_dir
    assert (outputs / net["artifacts"] / "w.txt").read_text() == "weights"
    assert tiny["params"] == {"lr": "0.1"}  # log_model gives the model the run's params
    assert sorted(p.name for p in (outputs / tiny["artifacts"]).iterdir()) == ["MLmodel", "model.bin"]
    # What a client would not send: MLflow's errors.
    token = env["MLFLOW_TRACKING_TOKEN"]
    r = _call(endpoint, "GET", f"logged-models/m-{'0' * 32}", token)
    assert r.status_code == 404 and r.json()["error_code"] == "RESOURCE_DOES_NOT_EXIST"
    r = _call(endpoint, "POST", "logged-models/search", token, json={"filter": "name ~ 'x'"})
    assert r.status_code == 400 and "filter" in r.json()["message"]
    r = _call(endpoint, "POST", "logged-models/search", token, json={"filter": "colour = 'red'"})
    assert r.status_code == 400 and "colour" in r.json()["message"]
    r = _call(endpoint, "GET", f"logged-models/{net['id']}/artifacts/directories", token)
    assert r.status_code == 404 and r.json()["error_code"] == "ENDPOINT_NOT_FOUND"
    r = _call(endpoint, "PATCH", f"logged-models/{net['id']}", token, json={"status": "DONE"})
    assert r.status_code == 400 and "status" in r.json()["message"]
    # MLflow 2's log_model records the model's metadata on the run: accepted (its files are
    # the run's artifacts).
    r = _call(endpoint, "POST", "runs/log-model", token, json={"run_id": run["id"], "model_json": "{}"})
    assert r.status_code == 200, r.text
    # MLflow's "View run" link names the endpoint: it answers with a page saying where to look.
    page = httpx.get(f"{endpoint.uri}/", timeout=10)
    assert page.status_code == 200 and "no web UI" in page.text
    assert env["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"  # and the client prints none


LIGHTNING_SCRIPT = """
import torch
from torch.utils.data import DataLoader, TensorDataset
import lightning as L
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Parser:  # the one call LightningCLI's config saving makes of its (jsonargparse) parser
    def save(self, config, path, **kwargs):
        open(path, "w").write("model: Net\\n")


torch.manual_seed(0)
data = TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
print("ALONE", L.Trainer(logger=MLFlowLogger(), enable_progress_bar=False).log_dir)
trainer = L.Trainer(
    max_epochs=2, logger=[CSVLogger("outputs"), MLFlowLogger()], log_every_n_steps=1,
    callbacks=[SaveConfigCallback(Parser(), {})], enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
)
trainer.fit(Net(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=6))
print("LOGDIR", trainer.log_dir)
"""


def test_lightnings_mlflow_logger_keeps_its_steps_and_a_logger_first_gives_lightning_cli_a_folder(
    endpoint: TrackingEndpoint, tmp_path: Path
) -> None:
    """Lightning's ``MLFlowLogger`` against the endpoint (2 epochs of 3 batches, on CPU): it
    logs ``epoch`` twice at each epoch's last step (with the training and the validation
    metrics), and every point keeps the step Lightning gave it. Alone it gives Lightning no
    folder (``trainer.log_dir`` is None for an http tracking URI, the ``assert log_dir is
    not None`` of LightningCLI's config saving); a CSV logger before it gives one, under
    ``outputs/``, where LightningCLI's callback saves its config."""
    pytest.importorskip("lightning")
    state = endpoint.store.state_dir
    env = {**os.environ, **endpoint.env_for(0, "rank-0")}
    done = subprocess.run(
        [sys.executable, "-c", LIGHTNING_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ALONE None" in done.stdout and "LOGDIR outputs/lightning_logs/version_0" in done.stdout
    assert (tmp_path / "outputs" / "lightning_logs" / "version_0" / "config.yaml").is_file()
    points = _lines(state / "metrics" / "mlflow-rank-0.jsonl")

    def steps(name: str) -> list[tuple[object, object]]:
        return [(p["step"], p.get("occurrence", 0)) for p in points if p["name"] == name]

    assert steps("train_loss") == [(s, 0) for s in range(6)]
    assert steps("val_loss") == [(2, 0), (5, 0)]
    assert steps("epoch") == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (4, 0), (5, 0), (5, 1)]


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
    mlflow.log_metric("again", 1.0)  # no step: MLflow's client sends step 0 each time
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
        # Each rank's steps are its own, and so are the values at one step.
        assert by_rank[rank] == [
            ("again", 0, 1.0), ("again", 0, 2.0),
            ("loss", 0, 10.0 * rank), ("loss", 1, 10.0 * rank + 1), ("loss", 2, 10.0 * rank + 2),
        ]  # fmt: skip
    assert by_rank[4] == [("loss", 0, 99.0)]
    again = sorted((p["rank"], p.get("occurrence", 0)) for p in points if p["name"] == "again")
    assert again == [(0, 0), (0, 1), (1, 0), (1, 1)]  # each rank's values at step 0 counted apart
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
