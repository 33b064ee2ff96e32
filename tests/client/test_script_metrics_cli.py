"""A script job's metrics and MLflow runs in the CLI: ``metrics`` by step where the job
reports steps only (MLflow, TensorBoard) and by epoch where its points span epochs, its own
metric names as columns (losses and accuracies first, as many as the width holds),
``--watch`` and ``submit --follow`` printing rows as they come, and the params and tags its
runs logged in ``show`` and ``compare``. The commands run in this process
(``torchyard.cli.main``); the jobs' points and runs arrive through the worker's report route."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer
from tests.support.factories import auth, create_token
from tests.support.report_helpers import make_script_job, point, post_report, start_running_job
from torchyard.cli import main
from torchyard.client import Client, Event, Job
from torchyard.commands.job_submit import follow_job


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``torchyard ARGV`` in this process; its stdout (it must succeed)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _run(run_id: str, name: str, params: dict[str, str], tags: dict[str, str]) -> dict[str, Any]:
    return {"id": run_id, "name": name, "experiment": "Default", "status": "FINISHED", "rank": 0,
            "params": params, "tags": tags}  # fmt: skip


# A script's own metric names, at steps 100, 200 and 300 (MLflow's: every point at epoch 0).
STEP_METRICS = {
    "lr": [0.001, 0.001, 0.0005],
    "accuracy": [0.5, 0.83, 0.8],
    "grad_norm": [3.0, 2.0, 1.5],
    "loss": [0.9, 0.4, 0.45],
}


@pytest.fixture
def scripts(live_server: LiveServer) -> Iterator[list[str]]:
    """Two script jobs: ``mlflow-steps`` reported steps only and one MLflow run; ``epochs``
    reported two epochs (``torchyard.run.log_metric``) and two runs."""
    settings = live_server.settings
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30) as admin:
        user = create_token(admin, "user", "sam")
        steps = start_running_job(settings, admin, per_node=1, user_token=user, name="mlflow-steps")
        make_script_job(settings, admin, steps)
        points = [
            point(name, value, epoch=0, step=step)
            for name, values in STEP_METRICS.items()
            for step, value in zip((100, 200, 300), values, strict=True)
        ]
        tags = {"team": "vision", "mlflow.user": "sam", "mlflow.source.name": "train.py"}
        runs = [_run("a" * 32, "train", {"lr": "0.001", "optimizer": "adam"}, tags)]
        assert post_report(admin, steps, metrics=points, tracking={"runs": runs}).status_code == 200
        epochs = start_running_job(settings, admin, per_node=1, user_token=user, name="epochs")
        make_script_job(settings, admin, epochs)
        points = [point("accuracy", v, epoch=e, step=s) for e, s, v in ((0, 10, 0.6), (1, 20, 0.7))]
        points += [point("loss", v, epoch=e, step=s) for e, s, v in ((0, 10, 0.8), (1, 20, 0.6))]
        runs = [
            _run("b" * 32, "pretrain", {"lr": "0.01"}, {}),
            _run("c" * 32, "finetune", {"lr": "0.002"}, {}),
        ]
        assert post_report(admin, epochs, metrics=points, tracking={"runs": runs}).status_code == 200
    yield ["--url", live_server.url, "--token", user]


def test_metrics_of_a_script_by_step_or_epoch_with_its_own_columns(
    scripts: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # stdout is no terminal: no width to fit
    lines = run(capsys, *scripts, "metrics", "mlflow-steps").splitlines()
    # A row per step, the job's own metrics as columns: losses and accuracies first.
    assert lines[0].split() == ["step", "loss", "accuracy", "grad_norm", "lr"]
    assert [line.split() for line in lines[1:]] == [
        ["100", "0.9", "0.5", "3", "0.001"],
        ["200", "0.4", "0.83", "2", "0.001"],
        ["300", "0.45", "0.8", "1.5", "0.0005"],
    ]
    # Too many for the width: the first columns that fit, and a note of the rest.
    monkeypatch.setenv("COLUMNS", "36")
    narrow = run(capsys, *scripts, "metrics", "mlflow-steps").splitlines()
    assert narrow[0].split() == ["step", "loss", "accuracy", "grad_norm"]
    assert narrow[-1].startswith("+1 more metric: lr") and "--name" in narrow[-1]
    assert max(len(line) for line in narrow[:-1]) <= 36
    # --name picks the columns; --raw lists the points.
    named = run(capsys, *scripts, "metrics", "mlflow-steps", "--name", "lr", "--name", "loss").splitlines()
    assert [line.split() for line in named] == [
        ["step", "loss", "lr"],
        ["100", "0.9", "0.001"],
        ["200", "0.4", "0.001"],
        ["300", "0.45", "0.0005"],
    ]
    raw = run(capsys, *scripts, "metrics", "mlflow-steps", "--raw", "--name", "lr").splitlines()
    assert raw[0].split()[:2] == ["SEQ", "NAME"] and len(raw) == 4
    # Points over two epochs: a row per epoch.
    by_epoch = run(capsys, *scripts, "metrics", "epochs").splitlines()
    assert [line.split() for line in by_epoch] == [
        ["epoch", "loss", "accuracy"],
        ["0", "0.8", "0.6"],
        ["1", "0.6", "0.7"],
    ]


def test_show_and_compare_give_what_the_mlflow_runs_logged(
    scripts: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = run(capsys, *scripts, "show", "mlflow-steps")
    section = shown[shown.index("mlflow runs:\n") :].splitlines()
    assert section[:5] == [
        "mlflow runs:",
        "  train  (rank 0, finished, experiment Default)",
        "    param  lr         0.001",
        "    param  optimizer  adam",
        "    tag    team       vision",
    ]
    assert "mlflow.user" not in shown and "mlflow.source" not in shown
    assert "pretrain  (rank 0" in run(capsys, *scripts, "show", "epochs")

    monkeypatch.setenv("COLUMNS", "200")
    text = run(capsys, *scripts, "compare", "mlflow-steps", "epochs")
    rows = {line.split("  ")[0]: line.split("  ")[-1].strip() for line in text.splitlines()}
    # One run: `mlflow: lr`; several: each row names its run.
    assert rows["mlflow: lr"] == "-" and rows["mlflow: pretrain: lr"] == "0.01"
    assert rows["mlflow: finetune: lr"] == "0.002" and rows["mlflow tag: team"] == "-"
    assert "mlflow.user" not in text
    # Each best where it was: a step for the job without epochs, an epoch for the other.
    assert "0.83 (step 200)" in text and "0.7 (epoch 1)" in text and "(epoch 0)" not in text


def _events(job: Job, script: list[tuple[str, dict[str, Any]]], seen: list[str], output: Any) -> Any:
    """A stand-in for ``Client.events``: each event of ``script`` in turn, noting in ``seen``
    what had been printed (``output()``) before the next one."""

    def events(self: Client, job_id: str, **kw: Any) -> Iterator[Event]:
        assert job_id == job.id
        for i, (kind, data) in enumerate(script):
            yield Event(id=str(i), kind=kind, data=data)
            seen.append(output())

    return events


def _step_points() -> list[tuple[str, dict[str, Any]]]:
    script: list[tuple[str, dict[str, Any]]] = [("status", {"status": "running"})]
    for step, (loss, acc) in ((100, (0.9, 0.5)), (200, (0.4, 0.83)), (300, (0.45, 0.8))):
        script += [
            ("metric", {"name": "accuracy", "value": acc, "epoch": 0, "step": step, "rank": 0}),
            ("metric", {"name": "loss", "value": loss, "epoch": 0, "step": step, "rank": 0}),
        ]
    return [*script, ("status", {"status": "succeeded", "final": True})]


def test_watch_and_follow_print_a_scripts_steps_as_they_come(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = Job(id="s" * 32, name="mlflow", status="running", type="script")
    monkeypatch.setattr(Client, "get_job", lambda self, ref: job)
    monkeypatch.delenv("COLUMNS", raising=False)
    printed: list[str] = []

    def output() -> str:
        printed.append(capsys.readouterr().out)
        return "".join(printed)

    seen: list[str] = []
    monkeypatch.setattr(Client, "events", _events(job, _step_points(), seen, output))
    capsys.readouterr()
    assert main(["--url", "http://127.0.0.1:9", "--token", "t", "metrics", job.id, "--watch"]) == 0
    output()
    lines = "".join(printed).splitlines()
    assert lines == [
        f"-- job {job.id} running",
        "step    loss      accuracy",
        "100     0.9       0.5",
        "200     0.4       0.83",
        "300     0.45      0.8",
        "status: succeeded",
    ]
    # Step 100's row as soon as step 200 began (event 3), not at the end.
    assert "100     0.9" not in seen[2] and "100     0.9" in seen[3]

    # submit --follow: the same rows, as lines of values.
    out = io.StringIO()
    seen.clear()
    monkeypatch.setattr(Client, "events", _events(job, _step_points(), seen, out.getvalue))
    with Client("http://127.0.0.1:9", "t") as client:
        follow_job(client, job, out=out)
    assert out.getvalue().splitlines() == [
        "status: running",
        "step 100  loss 0.9  accuracy 0.5",
        "step 200  loss 0.4  accuracy 0.83",
        "step 300  loss 0.45  accuracy 0.8",
        "status: succeeded",
    ]
    assert "step 100" in seen[3] and "step 200" not in seen[4]
