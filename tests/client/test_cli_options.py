"""What a new user meets across the commands: the global options before or after the
command, one rule for cancelling what had already ended, the tags in ``torchyard jobs`` and
its filters, datasets named in ``show``, the top-1 in ``model list``, and ``metrics --watch``
on a pipe while its job waits. Most commands run in this process (``torchyard.cli.main``)
against a live service; ``--watch`` runs as a real process, its output on a pipe."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.client.test_cli import cli_env
from tests.conftest import LiveServer
from tests.support.fake_agent import FakeAgent
from torchyard.apiclient.registry import ModelVersion, RegisteredModel
from torchyard.apiclient.sweeps import Sweep
from torchyard.cli import build_parser, main
from torchyard.client import Client, Job
from torchyard.sample_data import write_digits


@pytest.fixture
def spec(live_server: LiveServer, agent: FakeAgent, tmp_path: Path) -> dict[str, Any]:
    """A training job's spec on two small datasets (a node is ready: jobs are accepted)."""
    train, val = write_digits(tmp_path / "digits", per_class=2, size=16)
    with Client(live_server.url, live_server.admin_token) as client:
        return {
            "model": {"architecture": "resnet18"},
            "train_dataset": client.upload_dataset(train, "digits-train").id,
            "validation_dataset": client.upload_dataset(val, "digits-val").id,
        }


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``torchyard ARGV`` in this process: exit status, stdout, stderr."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_global_options_go_before_or_after_the_command(
    live_server: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TORCHYARD_URL", "TORCHYARD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    url, token = live_server.url, live_server.admin_token
    for argv in (
        ["--url", url, "--token", token, "--json", "jobs"],
        ["jobs", "--url", url, "--token", token, "--json"],
        ["--url", url, "jobs", "--token", token, "--json", "-v"],
        ["--json", "-v", "--token", token, "datasets", "list", "--url", url],
    ):
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
        assert json.loads(out) == [], argv
    # A value given before the command is not undone by the command's own default.
    parser = build_parser()
    before = parser.parse_args(["--url", "http://a:1", "--token", "t", "--json", "cancel", "job1"])
    assert (before.url, before.token, before.json, before.verbose) == ("http://a:1", "t", True, False)
    after = parser.parse_args(["cancel", "job1", "--url", "http://b:2", "-v"])
    assert (after.url, after.token, after.json, after.verbose) == ("http://b:2", None, False, True)
    assert parser.parse_args(["--token", "w", "worker", "--api", "http://a:1"]).token == "w"
    assert parser.parse_args(["serve", "-v"]).verbose is True


def test_cancelling_a_job_or_a_sweep_that_had_ended_is_no_failure(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule for both: it says the job or sweep had already ended, exit status 0."""
    job = Job(id="j" * 32, name="done", status="succeeded")
    sweep = Sweep(id="s" * 32, name="search", status="failed")
    monkeypatch.setattr(Client, "get_job", lambda self, ref: job)
    monkeypatch.setattr(Client, "cancel_job", lambda self, ref: job)
    monkeypatch.setattr(Client, "cancel_sweep", lambda self, ref: sweep)
    options = ["--url", "http://127.0.0.1:9", "--token", "t"]
    code, out, err = run(capsys, *options, "cancel", "done")
    assert code == 0, err
    assert out == f"{job.id} succeeded\n"
    assert f"job {job.id} had already ended (succeeded): there was nothing to cancel" in err
    code, out, err = run(capsys, *options, "sweep", "cancel", "search")
    assert code == 0, err
    assert out == f"sweep {sweep.id} failed\n"
    assert f"sweep {sweep.id} had already ended (failed): there was nothing to cancel" in err
    # Cancelled now, or before: nothing to say.
    cancelled = sweep.model_copy(update={"status": "cancelled"})
    monkeypatch.setattr(Client, "cancel_sweep", lambda self, ref: cancelled)
    code, out, err = run(capsys, *options, "sweep", "cancel", "search")
    assert (code, out, err) == (0, f"sweep {sweep.id} cancelled\n", "")


def test_jobs_shows_tags_and_filters_by_tag_and_sweep(
    live_server: LiveServer, spec: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--url", live_server.url, "--token", live_server.admin_token]
    with Client(live_server.url, live_server.admin_token) as client:
        plain = client.submit_job({**spec, "name": "plain"}).id
        base = client.submit_job({**spec, "name": "base"}).id
        both = client.submit_job({**spec, "name": "both"}).id
        client.update_job(base, tags=["baseline"])
        client.update_job(both, tags=["baseline", "lr-sweep", "a-rather-long-tag-name"])
        sweep = client.submit_sweep(
            {
                "name": "lr-search",
                "job": {**spec, "parameters": {"epochs": 1}},
                "search_space": {"parameters.learning_rate": {"type": "float", "low": 0.01, "high": 0.1}},
                "max_trials": 2,
                "max_concurrent_trials": 2,
            }
        )
        trials = sorted(t.job_id for t in client.get_sweep(sweep.id).trials or [])
        assert [j.id for j in client.list_jobs(tag=["baseline", "lr-sweep"]).items] == [both]

    code, out, err = run(capsys, *options, "jobs")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATUS", "PROGRESS", "ETA", "BEST", "TOP-1", "TAGS", "CREATED"]
    row = {line.split()[0]: line for line in lines[1:]}
    assert "  baseline,lr-sweep,a-rat…  " in row[both]  # compact: cut short to 24 characters
    # A queued job: no progress, no ETA, no best top-1, no tags.
    assert row[plain].split()[3:7] == ["-", "-", "-", "-"]

    code, out, _ = run(capsys, *options, "jobs", "--tag", "baseline")
    assert [line.split()[0] for line in out.splitlines()[1:]] == [both, base]
    code, out, _ = run(capsys, *options, "jobs", "--tag", "baseline", "--tag", "lr-sweep")
    assert [line.split()[0] for line in out.splitlines()[1:]] == [both]
    code, out, _ = run(capsys, *options, "jobs", "--sweep", "lr-search", "--json")
    assert sorted(j["id"] for j in json.loads(out)) == trials
    code, out, _ = run(capsys, *options, "jobs", "--sweep", sweep.id[:6], "--tag", "baseline", "--all")
    assert out.splitlines()[1:] == []
    code, _, err = run(capsys, *options, "jobs", "--sweep", "no-such-sweep")
    assert code == 1 and "NotFoundError" in err


def test_show_names_the_datasets(
    live_server: LiveServer, spec: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(live_server.url, live_server.admin_token) as client:
        job_id = client.submit_job(spec).id
    train, val = spec["train_dataset"], spec["validation_dataset"]
    code, out, err = run(capsys, "--url", live_server.url, "--token", live_server.admin_token, "show", job_id)
    assert code == 0, err
    assert f"datasets:    train digits-train ({train[:8]}), validation digits-val ({val[:8]})\n" in out


def test_model_list_shows_each_models_top1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def version(name: str, top1: float | None) -> ModelVersion:
        return ModelVersion(
            name=name, version=1, job_id="j" * 32, architecture="resnet18", classes=["a"], top1=top1
        )

    models = [
        RegisteredModel(name="digits", latest_version=1, versions=[version("digits", 0.9312)]),
        RegisteredModel(name="other", latest_version=1, versions=[version("other", None)]),
    ]
    monkeypatch.setattr(Client, "list_models", lambda self: models)
    code, out, err = run(capsys, "model", "list", "--url", "http://127.0.0.1:9", "--token", "t")
    assert code == 0, err
    header, digits, other = out.splitlines()
    assert header.split()[:5] == ["NAME", "VERSION", "ARCHITECTURE", "CLASSES", "TOP-1"]
    assert digits.split()[:5] == ["digits", "1", "resnet18", "1", "93.12%"]
    assert other.split()[4] == "-"


def test_watch_on_a_pipe_says_the_job_waits(live_server: LiveServer, spec: dict[str, Any]) -> None:
    """The job waits for the node its first job holds: ``--watch`` says so at once, in a
    plain line, not only when the job ends."""
    busy = {**spec, "resources": {"process_count_per_node": 2}}
    with Client(live_server.url, live_server.admin_token) as client:
        client.submit_job({**busy, "name": "first"})
        waiting = client.submit_job({**busy, "name": "second"})
        reason = client.get_job(waiting.id).reason
        for _ in range(50):
            if reason:
                break
            threading.Event().wait(0.1)
            reason = client.get_job(waiting.id).reason
        assert reason, "the second job does not wait"
        watch = subprocess.Popen(
            [sys.executable, "-m", "torchyard.cli", "metrics", waiting.id, "--watch"],
            env=cli_env(live_server),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            first: list[str] = []
            reader = threading.Thread(target=lambda: first.append(watch.stdout.readline()), daemon=True)  # type: ignore[union-attr]
            reader.start()
            reader.join(30)
            assert first == [f"-- job {waiting.id} queued ({reason})\n"], first
            client.cancel_job(waiting.id)
            out, err = watch.communicate(timeout=30)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.communicate()
    assert watch.returncode == 0, err
    assert "\x1b" not in first[0] + out
    assert out.splitlines()[-1].startswith("status: cancelled")
