"""The CLI around a job that ran: tags, note, clone, the log's tail and since, delete, and
the messages a new user meets (a short prefix, cancelling a finished job, an unknown
metric name, a service that is not there, a dataset name uploaded twice), as real
processes against a live service with a scripted agent."""

from __future__ import annotations

import argparse
import io
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.client.test_cli import cli, cli_env, fails, ok
from tests.conftest import LiveServer, free_port
from tests.service.test_streams import run_job as scripted_run
from tests.support.fake_agent import FakeAgent
from torchyard.client import Client
from torchyard.commands import parse_since
from torchyard.contract.errors import NotFoundError, RequestValidationError
from torchyard.sample_data import write_digits
from torchyard.terminal import LiveProgress


@pytest.fixture
def env(live_server: LiveServer) -> dict[str, str]:
    return cli_env(live_server)


class _Setup:  # what the scripted job runner needs
    agent: FakeAgent


def test_a_finished_job_tags_note_show_clone_tail_since_and_delete(
    env: dict[str, str], live_server: LiveServer, agent: FakeAgent, tmp_path: Path
) -> None:
    # Set up through the Python client: each CLI process costs an interpreter start.
    train, val = write_digits(tmp_path / "digits", per_class=3, size=16)
    with Client(live_server.url, live_server.admin_token) as client:
        spec = {
            "model": {"architecture": "resnet18"},
            "train_dataset": client.upload_dataset(train, "digits-train").id,
            "validation_dataset": client.upload_dataset(val, "digits-val").id,
        }
        job_id = client.submit_job(spec).id
        setup = _Setup()
        setup.agent = agent
        text = scripted_run(setup, job_id)  # 10 log lines, then the job fails
        lines = text.splitlines(keepends=True)

        # logs --tail and --since
        assert ok(cli(env, "logs", job_id, "--tail", "3")) == "".join(lines[-3:])
        assert ok(cli(env, "logs", job_id, "--since", "2100-01-01T00:00:00+00:00")) == ""
        assert ok(cli(env, "logs", job_id, "-n", "2", "-f")) == "".join(lines[-2:])  # it has ended
        bad = cli(env, "logs", job_id, "--since", "yesterday")
        assert bad.returncode == 2 and "duration such as 10m" in bad.stderr
        assert client.logs(job_id, since=datetime.now(UTC) - timedelta(hours=1)) == text

        # tags and a note, shown by `show`
        assert (
            ok(cli(env, "tag", job_id, "baseline", "lr-0.05", "x"))
            .strip()
            .endswith("tags: baseline, lr-0.05, x")
        )
        assert ok(cli(env, "tag", job_id, "x", "--remove")).strip().endswith("tags: baseline, lr-0.05")
        ok(cli(env, "note", job_id, "first try\nwith a second line"))
        shown = ok(cli(env, "show", job_id))
        assert "tags:        baseline, lr-0.05\n" in shown
        assert "note:        first try\n             with a second line\n" in shown
        # `show` writes values for people: no Python reprs, no raw floats, no microseconds
        assert "None" not in shown and "init_from_job" not in shown
        assert not re.search(r"\d\.\d{7,}", shown), shown
        assert not re.search(r"\d\d:\d\d:\d\d\.\d", shown), shown
        assert "learning_rate=0.001" in shown and "pretrained=false" in shown
        assert client.get_job(job_id).tags == ["baseline", "lr-0.05"]
        assert client.update_job(job_id, note=None).note is None
        with pytest.raises(RequestValidationError):
            client.update_job(job_id, tags=["two words"])

        # what a new user meets
        short = fails(cli(env, "show", job_id[:3]), "NotFoundError")
        assert "an id prefix needs at least 4 characters" in short
        cancelled = cli(env, "cancel", job_id)  # no failure: it says so (as `sweep cancel` does)
        assert cancelled.returncode == 0 and "had already ended (failed)" in cancelled.stderr
        assert cancelled.stdout == f"{job_id} failed\n"
        unknown = cli(env, "metrics", job_id, "--name", "val.loss", "--name", "nope")
        assert unknown.returncode == 1 and "has no metric 'nope'" in unknown.stderr
        assert "epoch.seconds, train.loss, val.loss" in unknown.stderr

        # clone: the same spec as a new job
        clone_id = ok(cli(env, "clone", job_id)).strip()
        clone, source = client.get_job(clone_id), client.get_job(job_id)
        assert clone_id != job_id and clone.status in ("queued", "scheduled")
        assert clone.train_dataset == source.train_dataset and clone.parameters == source.parameters

        # delete: an unfinished job is refused; the finished one goes with its logs and metrics
        assert "cancel it first" in fails(cli(env, "delete", clone_id), "ConflictError")
        assert ok(cli(env, "delete", job_id)).startswith(f"deleted job {job_id}")
        with pytest.raises(NotFoundError):
            client.get_job(job_id)
        assert [j.id for j in client.list_jobs().items] == [clone_id]


def test_an_unreachable_service_says_how_to_point_at_it_before_packing(
    env: dict[str, str], tmp_path: Path
) -> None:
    down = {**env, "TORCHYARD_URL": f"http://127.0.0.1:{free_port()}"}
    folder, _ = write_digits(tmp_path / "digits", per_class=2, size=16)
    result = cli(down, "datasets", "upload", "digits", str(folder))
    line = fails(result, "ServiceUnreachableError", exit_code=3)
    assert "TORCHYARD_URL" in line and "--url" in line
    assert "packing" not in result.stderr  # the service is asked first


def test_uploading_a_dataset_name_again_warns_or_replaces(env: dict[str, str], tmp_path: Path) -> None:
    folder, _ = write_digits(tmp_path / "digits", per_class=2, size=16)
    first = ok(cli(env, "datasets", "upload", "digits", str(folder))).strip()
    again = cli(env, "datasets", "upload", "digits", str(folder))
    second = ok(again).strip()
    assert (
        f"a dataset named 'digits' exists already ({first})" in again.stderr and "--replace" in again.stderr
    )
    replaced = cli(env, "datasets", "upload", "digits", str(folder), "--replace")
    third = ok(replaced).strip()
    assert "exists already" not in replaced.stderr
    listed = json.loads(ok(cli(env, "datasets", "list", "--json")))
    assert [d["id"] for d in listed] == [third]
    assert first in replaced.stderr and second in replaced.stderr


def test_follow_prints_a_script_jobs_last_epoch() -> None:
    """A script's metrics carry no epoch duration: its last epoch is printed when the job ends.
    Its first epoch is one of steps until a second begins: a line per step, then a line per
    epoch from the first."""
    out = io.StringIO()
    progress = LiveProgress(out)
    for epoch in (0, 1):
        for step, loss in ((epoch * 10 + 5, 0.9 - epoch / 4), (epoch * 10 + 9, 0.8 - epoch / 4)):
            progress.handle(
                "metric", {"name": "train.loss", "value": loss, "epoch": epoch, "step": step, "rank": 0}
            )
        progress.handle(
            "metric", {"name": "val.top1", "value": 0.5 + epoch / 4, "epoch": epoch, "step": step, "rank": 0}
        )
    progress.handle("status", {"status": "succeeded", "final": True})
    printed = out.getvalue().splitlines()
    assert printed == [
        "step 5  train.loss 0.9000",
        "epoch 0  train.loss 0.8000  val.top1 50.00%",
        "epoch 1  train.loss 0.5500  val.top1 75.00%",
        "status: succeeded",
    ]


def test_since_takes_durations_and_times() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_since("90s", now) == now - timedelta(seconds=90)
    assert parse_since("10m", now) == now - timedelta(minutes=10)
    assert parse_since("1.5h", now) == now - timedelta(minutes=90)
    assert parse_since("2d", now) == now - timedelta(days=2)
    assert parse_since("2026-01-01T00:00:00+00:00") == datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_since("2026-01-01T00:00:00").tzinfo is not None  # local time
    # "²" is a digit to str.isdigit() that float() refuses: not a duration either
    for text in ("\u00b2s", "1\u00b2m", "\u0661h"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a duration"):
            parse_since(text, now)
