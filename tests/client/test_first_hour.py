"""A new user's first hour: ids, names and id prefixes wherever an id is taken (over
real HTTP and through the real CLI), the message when no token is found, epoch
progress with elapsed time and time left, and the README and demo telling how to go on.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from service.config import Settings
from service.db.engine import Database
from service.db.models import Dataset, Job
from service.db.types import utcnow
from tests.client.test_cli import cli, cli_env, fails, ok, spawn_cli
from tests.conftest import LiveServer
from tests.support import REPO_ROOT
from tests.support.factories import auth, create_token, job_spec, register_node, token_id
from tests.support.fake_agent import FakeAgent
from torchyard.client import Job as JobModel
from torchyard.demo import DemoService, _summary, command_hint
from torchyard.sample_data import write_digits
from torchyard.terminal import (
    EpochLines,
    EpochTable,
    LiveProgress,
    format_duration,
    job_timing,
    remaining_seconds,
    timing_text,
)

ROOT = REPO_ROOT


# --------------------------------------------------------------------------- helpers


def insert_dataset(settings: Settings, owner: str, dataset_id: str, name: str) -> str:
    """A dataset row with a chosen id (ids sharing a prefix cannot be had otherwise)."""
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.add(
                Dataset(
                    id=dataset_id,
                    owner_id=owner,
                    name=name,
                    source="upload",
                    storage_path="unused",
                    classes=["a", "b"],
                    class_counts={"a": 2, "b": 2},
                    num_images=4,
                    size_bytes=100,
                    sha256="0" * 64,
                )
            )
    finally:
        db.dispose()
    return dataset_id


def clone_job(settings: Settings, source_id: str, new_id: str, owner: str) -> str:
    """A queued copy of a submitted job under a chosen id and owner."""
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            src = session.get(Job, source_id)
            assert src is not None
            now = utcnow()
            session.add(
                Job(
                    id=new_id,
                    owner_id=owner,
                    name=f"copy-{new_id[:6]}",
                    status="queued",
                    spec=src.spec,
                    architecture=src.architecture,
                    train_dataset_id=src.train_dataset_id,
                    validation_dataset_id=src.validation_dataset_id,
                    node_count=1,
                    process_count_per_node=1,
                    priority=0,
                    created_at=now,
                    updated_at=now,
                )
            )
    finally:
        db.dispose()
    return new_id


def error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    body: dict[str, Any] = response.json()
    assert body["code"] == code, body
    return body


# --------------------------------------------------------------------------- the API (SQLite and PostgreSQL)


@pytest.mark.both_databases
def test_names_and_unique_id_prefixes_in_path_params(live_server: LiveServer, settings: Settings) -> None:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
        alice_token = create_token(admin, "user", "alice")
        bob_token = create_token(admin, "user", "bob")
        register_node(admin, create_token(admin, "worker"), "n1", 4)
        alice, bob = token_id(admin, alice_token), token_id(admin, bob_token)

    a1 = insert_dataset(settings, alice, "abcd" + "1" * 28, "digits-train")
    a2 = insert_dataset(settings, alice, "abcd" + "2" * 28, "digits-val")
    t1 = insert_dataset(settings, alice, "aa11" + "3" * 28, "twin")
    t2 = insert_dataset(settings, alice, "bb22" + "4" * 28, "twin")
    b1 = insert_dataset(settings, bob, "abcd" + "9" * 28, "bobs")  # shares alice's prefix abcd
    b2 = insert_dataset(settings, bob, "beef" + "5" * 28, "twin")  # and her name twin

    with (
        httpx.Client(base_url=live_server.url, headers=auth(alice_token), timeout=30) as a,
        httpx.Client(base_url=live_server.url, headers=auth(bob_token), timeout=30) as b,
        httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30) as root,
    ):
        # a unique id prefix and a name work like the id
        assert a.get("/v1/datasets/abcd1").json()["id"] == a1
        assert a.get("/v1/datasets/ABCD2222").json()["id"] == a2
        assert a.get("/v1/datasets/digits-val").json()["id"] == a2
        assert a.get(f"/v1/datasets/{a1}").json()["id"] == a1

        # an ambiguous prefix or name: a 409 naming the candidates, only the caller's own
        body = error(a.get("/v1/datasets/abcd"), 409, "AmbiguousReferenceError")
        assert {c["id"] for c in body["details"]["candidates"]} == {a1, a2}
        assert a1 in body["message"] and a2 in body["message"] and "more characters" in body["message"]
        assert b1 not in a.get("/v1/datasets/abcd").text
        body = error(a.get("/v1/datasets/twin"), 409, "AmbiguousReferenceError")
        assert {c["id"] for c in body["details"]["candidates"]} == {t1, t2}
        assert {c["name"] for c in body["details"]["candidates"]} == {"twin"}
        assert b2 not in a.get("/v1/datasets/twin").text
        # an admin may list everything, so everything is a candidate for an admin
        body = error(root.get("/v1/datasets/abcd"), 409, "AmbiguousReferenceError")
        assert {c["id"] for c in body["details"]["candidates"]} == {a1, a2, b1}

        # another user's id, prefix or name behaves as unknown; so does a too short prefix
        for ref in (b1, "beef", "beef5555", "bobs", "abc"):
            body = error(a.get(f"/v1/datasets/{ref}"), 404, "NotFoundError")
            assert ref in body["message"] and "bob" not in body["message"].replace(f"'{ref}'", "")
        # ... while the prefix alice shares with bob is unique among bob's own
        assert b.get("/v1/datasets/abcd").json()["id"] == b1
        assert b.get("/v1/datasets/twin").json()["id"] == b2

        # jobs: submitted by id, then found by name and prefix on every route under {id}
        first = a.post("/v1/jobs", json=job_spec(a1, a2, name="first")).json()["id"]
        same = {a.post("/v1/jobs", json=job_spec(a1, a2, name="same")).json()["id"] for _ in range(2)}
        assert a.get("/v1/jobs/first").json()["id"] == first
        assert a.get(f"/v1/jobs/{first[:8]}").json()["id"] == first
        assert a.get("/v1/jobs/first/metrics").json() == {"items": [], "next_after": 0}
        assert a.get(f"/v1/jobs/{first[:8]}/logs/streams").status_code == 200
        body = error(a.get("/v1/jobs/same"), 409, "AmbiguousReferenceError")
        assert {c["id"] for c in body["details"]["candidates"]} == same
        assert all(c["status"] for c in body["details"]["candidates"])
        error(a.post("/v1/jobs/same/cancel"), 409, "AmbiguousReferenceError")
        cancelled = a.post(f"/v1/jobs/{first[:8]}/cancel").json()
        assert cancelled["id"] == first and cancelled["status"] in ("cancelled", "cancelling")
        # ... never by another user
        for ref in ("first", first[:8], first):
            error(b.get(f"/v1/jobs/{ref}"), 404, "NotFoundError")
            error(b.post(f"/v1/jobs/{ref}/cancel"), 404, "NotFoundError")
            error(b.get(f"/v1/jobs/{ref}/metrics"), 404, "NotFoundError")
        # an ambiguous job id prefix, among the caller's jobs only
        c1 = clone_job(settings, first, "cafe" + "1" * 28, alice)
        c2 = clone_job(settings, first, "cafe" + "2" * 28, alice)
        c3 = clone_job(settings, first, "cafe" + "3" * 28, bob)
        body = error(a.get("/v1/jobs/cafe"), 409, "AmbiguousReferenceError")
        assert {c["id"] for c in body["details"]["candidates"]} == {c1, c2}
        assert c3 not in body["message"]
        assert b.get("/v1/jobs/cafe").json()["id"] == c3
        assert a.get("/v1/jobs/cafe2").json()["id"] == c2

        # text no id or name can hold (PostgreSQL refuses a NUL outright) is simply not found
        for path in ("/v1/jobs/%00", "/v1/jobs/ab%00cd/metrics", "/v1/datasets/twin%00"):
            error(a.get(path), 404, "NotFoundError")
        error(a.post("/v1/jobs/%00/cancel"), 404, "NotFoundError")
        error(a.delete("/v1/datasets/%00"), 404, "NotFoundError")

        # delete by name; a deleted dataset is no candidate any more
        assert a.delete("/v1/datasets/bb22").status_code == 204
        assert a.get("/v1/datasets/twin").json()["id"] == t1
        error(a.delete("/v1/datasets/bobs"), 404, "NotFoundError")
        assert b.get(f"/v1/datasets/{b1}").status_code == 200


# --------------------------------------------------------------------------- the CLI (SQLite)


class TestCommandLine:
    @pytest.fixture
    def db_url(self, sqlite_url: str) -> str:
        return sqlite_url

    @pytest.fixture
    def env(self, live_server: LiveServer) -> dict[str, str]:
        return cli_env(live_server)

    @pytest.fixture
    def agent(self, live_server: LiveServer) -> Iterator[FakeAgent]:
        with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
            worker = create_token(admin, "worker")
        a = FakeAgent(live_server.url, worker, units=1)
        yield a
        a.close()

    @pytest.fixture
    def digits(self, tmp_path: Path) -> tuple[Path, Path]:
        return write_digits(tmp_path / "digits", per_class=3, size=16)

    def test_names_and_prefixes_in_every_command(
        self, env: dict[str, str], agent: FakeAgent, digits: tuple[Path, Path], live_server: LiveServer
    ) -> None:
        train = ok(cli(env, "datasets", "upload", "digits-train", str(digits[0]))).strip()
        val = ok(cli(env, "datasets", "upload", "digits-val", str(digits[1]))).strip()
        assert f"id:       {train}" in ok(cli(env, "datasets", "show", "digits-train"))
        assert f"id:       {val}" in ok(cli(env, "datasets", "show", val[:6]))

        # the same name twice: show names both; submit --val takes the newest
        again = ok(cli(env, "datasets", "upload", "digits-val", str(digits[1]))).strip()
        line = fails(cli(env, "datasets", "show", "digits-val"), "AmbiguousReferenceError")
        assert val in line and again in line
        first = ok(
            cli(
                env,
                "submit",
                "--arch",
                "resnet18",
                "--train",
                "digits-train",
                "--val",
                "digits-val",
                "--name",
                "twice",
            )
        ).strip()
        assert ok(cli(env, "show", first, "--json")).count(again) == 1
        second = ok(
            cli(env, "submit", "--arch", "resnet18", "--train", train[:5], "--val", val, "--name", "twice")
        ).strip()
        line = fails(cli(env, "show", "twice"), "AmbiguousReferenceError")
        assert first in line and second in line
        for command in (["cancel"], ["logs"], ["metrics"], ["download"]):
            fails(cli(env, *command, "twice"), "AmbiguousReferenceError")

        # a unique prefix in the job commands
        assert f"id:          {second}" in ok(cli(env, "show", second[:8]))
        assert ok(cli(env, "metrics", second[:8])).strip() == "no metrics yet"
        assert ok(cli(env, "logs", second[:8])) == ""
        fails(cli(env, "download", second[:8]), "ModelNotReadyError")
        assert ok(cli(env, "cancel", second[:8])).split() in ([second, "cancelled"], [second, "cancelling"])

        # delete by a prefix (the one job that used it is cancelled), after which the name is unique again
        ok(cli(env, "datasets", "delete", val[:8]))
        assert f"id:       {again}" in ok(cli(env, "datasets", "show", "digits-val"))

        # another user's objects are not found by name or prefix
        with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
            user = create_token(admin, "user")
        other = {**env, "TORCHYARD_TOKEN": user}
        fails(cli(other, "datasets", "show", "digits-train"), "NotFoundError")
        fails(cli(other, "datasets", "delete", train[:8]), "NotFoundError")
        fails(cli(other, "show", second[:8]), "NotFoundError")
        fails(cli(other, "cancel", "twice"), "NotFoundError")

    def test_no_token_names_the_token_file_and_the_variable(
        self, live_server: LiveServer, tmp_path: Path
    ) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        data = tmp_path / "elsewhere"
        env = {**base, "TORCHYARD_URL": live_server.url, "TORCHYARD_DATA_DIR": str(data)}
        line = fails(cli(env, "jobs"), "AuthenticationError")
        assert str(data / "admin.token") in line and "does not exist" in line
        assert "TORCHYARD_TOKEN" in line and "TORCHYARD_DATA_DIR" in line
        # with nothing set: the default data directory, relative to where the command runs
        (tmp_path / "cwd" / "torchyard-data").mkdir(parents=True)
        (tmp_path / "cwd" / "torchyard-data" / "admin.token").write_text("\n")
        line = fails(
            cli({**base, "TORCHYARD_URL": live_server.url}, "cluster", cwd=tmp_path / "cwd"),
            "AuthenticationError",
        )
        assert "torchyard-data/admin.token is empty" in line and "TORCHYARD_DATA_DIR is not set" in line
        assert "TORCHYARD_TOKEN" in line

    def test_progress_with_elapsed_time_and_time_left(
        self, env: dict[str, str], agent: FakeAgent, digits: tuple[Path, Path]
    ) -> None:
        ok(cli(env, "datasets", "upload", "digits-train", str(digits[0])))
        ok(cli(env, "datasets", "upload", "digits-val", str(digits[1])))
        job_id = ok(
            cli(
                env,
                "submit",
                "--arch",
                "resnet18",
                "--train",
                "digits-train",
                "--val",
                "digits-val",
                "--epochs",
                "4",
                "--name",
                "watched",
            )
        ).strip()

        watch = spawn_cli(env, "metrics", "watched", "--watch")  # stdout is a pipe, not a terminal
        follow = spawn_cli(env, "logs", job_id[:8], "-f")
        placement = agent.claim()
        agent.status(placement, "running")
        offset = 0
        for epoch in (1, 2):
            offset = agent.log(placement, "rank-0", offset, f"epoch {epoch} training\n")
            agent.metric(placement, "train.loss", 1.0 / epoch, epoch, epoch * 10)
            agent.metric(placement, "train.lr", 0.000125, epoch, epoch * 10)
            agent.metric(placement, "val.loss", 12.5 / epoch, epoch, epoch * 10)
            agent.metric(placement, "val.top1", 0.5 + epoch / 10, epoch, epoch * 10)
            agent.metric(placement, "epoch.seconds", 1.5 if epoch == 1 else 62.5, epoch, epoch * 10)
            agent.report(
                placement, progress={"epoch": epoch, "epochs": 4, "step": epoch * 10, "total_steps": 40}
            )
        shown = ok(cli(env, "show", "watched"))
        assert re.search(r"^time:        elapsed \S+, about \S+ left$", shown, re.M), shown
        failure = {"code": "RankFailedError", "message": "rank 0 raised", "rank": 0, "node": agent.name}
        agent.status(placement, "failed", exit_code=1, failure=failure)

        watched, err = watch.communicate(timeout=60)
        assert watch.returncode == 0, err
        lines = watched.rstrip("\n").splitlines()
        # Status lines and step lines (`metrics --watch` on a pipe, while an epoch runs)
        # aside: the table.
        statuses = [line for line in lines if line.startswith(f"-- job {job_id} ")]
        assert statuses[-1] == f"-- job {job_id} running (ranks started on {agent.name})", lines
        lines = [line for line in lines if line not in statuses]
        steps = [line for line in lines if line.startswith("-- ")]
        assert all(line.startswith("-- epoch") and "  step " in line for line in steps), steps
        lines = [line for line in lines if not line.startswith("-- ")]
        assert lines[0].split() == [
            "epoch",
            "train.loss",
            "val.loss",
            "val.top1",
            "lr",
            "seconds",
            "elapsed",
            "left",
        ]
        rows = lines[1:-1]
        assert [r.split()[0] for r in rows] == ["1", "2"]
        # elapsed: the epochs' durations so far; left: the remaining epochs at that pace
        assert [r.split()[-2:] for r in rows] == [["2s", "4s"], ["1m04s", "1m04s"]]
        starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
        for row in rows:  # every value starts under its header, in a pipe as on a terminal
            assert [m.start() for m in re.finditer(r"\S+", row)] == starts, "\n".join(lines)
        assert lines[-1].startswith("status: failed")

        out, err = follow.communicate(timeout=60)
        assert follow.returncode == 0, err
        assert out == "epoch 1 training\nepoch 2 training\n"  # stdout is the log alone
        assert "-- epoch 1/4 done: elapsed 2s, about 4s left" in err
        assert "-- epoch 2/4 done: elapsed 1m04s, about 1m04s left" in err
        assert re.search(r"^time:        took \S+$", ok(cli(env, "show", job_id[:6])), re.M)


# --------------------------------------------------------------------------- formatting


def test_format_duration() -> None:
    assert [format_duration(s) for s in (None, -1.0, 0, 4.4, 59.4, 60, 65, 3599, 3600, 7620.0)] == [
        "-",
        "-",
        "0s",
        "4s",
        "59s",
        "1m00s",
        "1m05s",
        "59m59s",
        "1h00m",
        "2h07m",
    ]
    assert format_duration(float("nan")) == "-"


def test_remaining_time_and_job_timing() -> None:
    assert remaining_seconds(30.0, 0.25) == 90.0
    assert remaining_seconds(30.0, 1.0) == 0.0
    assert remaining_seconds(30.0, 0.0) is None and remaining_seconds(None, 0.5) is None
    assert timing_text(72.0, 48.0) == "elapsed 1m12s, about 48s left"
    assert timing_text(72.0, None) == "elapsed 1m12s"
    start = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert job_timing(None, None, 0.5) == ""
    assert (
        job_timing(start, None, 0.4, now=start + timedelta(seconds=120)) == "elapsed 2m00s, about 3m00s left"
    )
    assert job_timing(start, None, None, now=start + timedelta(seconds=5)) == "elapsed 5s"
    assert job_timing(start, start + timedelta(seconds=185), 1.0) == "took 3m05s"


def _table(seconds: list[float], **extra: float) -> EpochTable:
    table = EpochTable()
    for epoch, s in enumerate(seconds, start=1):
        for name, value in {"train.loss": 1.0 / epoch, **extra, "epoch.seconds": s}.items():
            table.add({"name": name, "value": value, "epoch": epoch, "rank": 0})
    return table


def test_epoch_timing_from_the_epoch_durations() -> None:
    table = _table([10.0, 20.0])
    assert table.timing(1, 5) == (10.0, 40.0)
    assert table.timing(2, 5) == (30.0, 45.0)
    assert table.timing(2, None) == (30.0, None)
    assert EpochTable().timing(1, 5) == (None, None)


def test_epoch_lines_are_fixed_width() -> None:
    table = _table(
        [1.25, 1234.5, 4000.0], **{"train.lr": 0.000125, "val.top1": 1.0, "train.images_per_sec": 12345.6}
    )
    lines = EpochLines(table, 100)
    text = [lines.header()] + [lines.row(e) for e in (1, 2, 3)]
    starts = [m.start() for m in re.finditer(r"\S+", text[0])]
    assert len(starts) == 8
    for line in text[1:]:
        assert [m.start() for m in re.finditer(r"\S+", line)] == starts, "\n".join(text)
    assert text[3].split()[-2:] == ["1h27m", "47h01m"]  # 5236 s for 3 of 100 epochs


def test_live_progress_epoch_lines_carry_the_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # no terminal width to fit (xdist sets one)
    out = io.StringIO()
    progress = LiveProgress(out, epochs=3)
    for name, value in (("train.loss", 0.5), ("val.loss", 0.4), ("epoch.seconds", 20.0)):
        progress.handle("metric", {"name": name, "value": value, "epoch": 1, "step": 5, "rank": 0})
    assert (
        out.getvalue()
        == "epoch 1/3  train.loss 0.5000  val.loss 0.4000  seconds 20.0  elapsed 20s  left 40s\n"
    )


# --------------------------------------------------------------------------- README and demo


def _readme_section(title: str) -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(rf"^## {title}\n(.*?)(?=^## )", readme, re.S | re.M)
    assert match, title
    return match.group(1)


def test_readme_example_is_the_small_fast_demo_job() -> None:
    using = _readme_section("Using it")
    spec_block = re.search(r"```yaml\n(.*?)```", using, re.S)
    assert spec_block
    spec = yaml.safe_load(spec_block.group(1))
    params = spec["parameters"]
    demo_defaults = _demo_defaults()
    # the demo's job: 32 px and a rate that trains from scratch in a few epochs, not 224 px
    assert params["image_size"] == 32 and params["augmentation"] == "light"
    assert params["learning_rate"] == demo_defaults.lr and params["batch_size"] == demo_defaults.batch_size
    assert params["epochs"] == demo_defaults.epochs
    assert "224 px" in using and "couple of minutes" in using
    # where the command and the folders come from
    assert "source .venv/bin/activate" in using and ".venv/bin/torchyard" in using
    assert "torchyard datasets upload digits-train torchyard-demo/digits/train" in using
    assert "written by `torchyard demo`" in using


def test_readme_sample_image_is_one_the_demo_writes(tmp_path: Path) -> None:
    using = _readme_section("Using it")
    match = re.search(r"torchyard predict model/ torchyard-demo/digits/(\S+)", using)
    assert match
    _train, val = write_digits(tmp_path / "digits", size=32)  # what `torchyard demo` writes by default
    assert (val.parent / match.group(1)).is_file()


def _demo_defaults() -> argparse.Namespace:
    from torchyard.cli import build_parser

    return build_parser().parse_args(["demo"])


def _fake_venv(root: Path) -> Path:
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "torchyard", "activate"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir / "python"


def test_demo_next_steps_say_how_to_get_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    python = _fake_venv(tmp_path)
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    root = Path("torchyard-demo")
    job = JobModel(
        id="f" * 32, name="digits-resnet18", status="succeeded", best={"val.top1": 0.9, "epoch": 2}
    )
    out = io.StringIO()
    service = DemoService(root / "data", 8123, None, root / "serve.log")
    _summary(
        out,
        job,
        service,
        (root / "data").resolve(),
        root / "models" / job.id,
        root / "digits" / "val",
        60.0,
        _demo_defaults(),
    )
    text = out.getvalue()
    assert ".venv/bin/torchyard, not on your PATH" in text
    assert re.search(r"^    source \.venv/bin/activate +# puts `torchyard` on PATH", text, re.M)
    assert "sample data:   torchyard-demo/digits/train and torchyard-demo/digits/val" in text
    assert "`torchyard demo` wrote" in text
    # The job by its id: the demo's job has the same name each run, so a second run would
    # make the name ambiguous.
    assert f"torchyard metrics {job.id[:8]} " in text and f"torchyard logs {job.id[:8]}" in text
    assert "torchyard metrics digits-resnet18" not in text
    # The service stops with the demo: the web UI is offered through --keep-running, not by a
    # URL that no longer answers.
    assert "torchyard demo --keep-running" in text and "8123" not in text
    assert "http://127.0.0.1:8000/" in text


def test_demo_next_steps_with_keep_running_name_the_web_ui(tmp_path: Path) -> None:
    root = tmp_path / "torchyard-demo"
    job = JobModel(
        id="e" * 32, name="digits-resnet18", status="succeeded", best={"val.top1": 0.97, "epoch": 4}
    )
    out = io.StringIO()
    service = DemoService(root / "data", 8123, None, root / "serve.log")
    args = _demo_defaults()
    args.keep_running = True
    _summary(
        out,
        job,
        service,
        (root / "data").resolve(),
        root / "models" / job.id,
        root / "digits" / "val",
        60.0,
        args,
    )
    text = out.getvalue()
    assert "web UI:        http://127.0.0.1:8123/ (up until you press Ctrl-C" in text
    assert "--keep-running" not in text


def test_command_hint_when_the_command_is_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    python = _fake_venv(tmp_path)
    where, setup = command_hint(python, str(python.parent))
    assert setup is None and "is on your PATH" in where
    # no console script (run as python -m): the module form
    (python.parent / "torchyard").unlink()
    where, setup = command_hint(python, str(tmp_path / "empty"))
    assert setup is None and f"{python} -m torchyard.cli" in where


def test_a_live_line_narrower_than_its_metrics_keeps_the_accuracy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    progress = LiveProgress(out, epochs=2)
    metrics = (
        ("train.loss", 0.5), ("train.lr", 0.02), ("train.images_per_sec", 150.0), ("val.loss", 0.4),
        ("val.top1", 0.9889), ("val.top5", 1.0), ("epoch.seconds", 20.0),
    )  # fmt: skip
    for name, value in metrics:
        progress.handle("metric", {"name": name, "value": value, "epoch": 1, "step": 5, "rank": 0})
    progress.handle("metric", {"name": "train.loss", "value": 0.3, "epoch": 2, "step": 10, "rank": 0})
    line = out.getvalue().splitlines()[0]
    assert line.startswith("epoch 1/2  val.top1 98.89%") and len(line) <= 80, line
    assert "more" in line
