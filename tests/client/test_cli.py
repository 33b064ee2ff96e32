"""Every user command of ``torchyard`` as a real process against a live service.

A scripted agent (the real worker routes, no training) moves jobs along; the commands
that need a trained model run in ``tests/e2e/test_cli_training.py``. The service side of
these routes is covered on SQLite and PostgreSQL elsewhere; here the client matters,
so these run on SQLite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import LiveServer, free_port
from tests.service.test_streams import run_job as scripted_run
from tests.support.factories import auth, create_token
from tests.support.fake_agent import FakeAgent
from torchyard.contract.model_archive import sha256_of
from torchyard.sample_data import write_digits


@pytest.fixture
def settings(make_settings: Any, tmp_path: Path) -> Settings:
    shared = tmp_path / "shared"
    shared.mkdir()
    return make_settings(dataset_roots=[shared])  # type: ignore[no-any-return]


def cli_env(server: LiveServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_URL=server.url, TORCHYARD_TOKEN=server.admin_token, **extra)
    return env


def cli(
    env: dict[str, str], *args: str, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchyard.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def spawn_cli(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """A CLI command left running (``-f``, ``--watch``), its output on pipes."""
    return subprocess.Popen(
        [sys.executable, "-m", "torchyard.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    )
    return result.stdout


def fails(result: subprocess.CompletedProcess[str], code: str, exit_code: int = 1) -> str:
    """The one-line error of a failed command: ``error: <code>: <message>``."""
    assert result.returncode == exit_code, (result.returncode, result.stdout, result.stderr)
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {code}: "), result.stderr
    assert "Traceback" not in result.stderr
    return line


@pytest.fixture
def env(live_server: LiveServer) -> dict[str, str]:
    return cli_env(live_server)


@pytest.fixture
def digits(tmp_path: Path) -> tuple[Path, Path]:
    return write_digits(tmp_path / "digits", per_class=5, size=16)


def upload_both(env: dict[str, str], digits: tuple[Path, Path]) -> tuple[str, str]:
    train = ok(cli(env, "datasets", "upload", str(digits[0]), "--name", "digits-train")).strip()
    val = ok(cli(env, "datasets", "upload", "digits-val", str(digits[1]))).strip()  # NAME PATH works too
    return train, val


def test_datasets_commands(
    env: dict[str, str], digits: tuple[Path, Path], tmp_path: Path, settings: Settings
) -> None:
    train_id, val_id = upload_both(env, digits)
    # an archive file is uploaded as it is
    archive = shutil.make_archive(str(tmp_path / "val-archive"), "zip", digits[1])
    shown = json.loads(ok(cli(env, "datasets", "upload", archive, "--json")))
    assert shown["name"] == "val-archive" and shown["num_images"] == 10 and len(shown["classes"]) == 10
    # a folder on shared storage is registered, not uploaded
    shared = settings.dataset_roots[0] / "digits-train"
    shutil.copytree(digits[0], shared)
    registered = json.loads(ok(cli(env, "datasets", "upload", "--path", str(shared), "--json")))
    assert registered["source"] == "path" and registered["num_images"] == 40

    table = ok(cli(env, "datasets", "list"))
    assert table.splitlines()[0].split()[:3] == ["ID", "NAME", "SOURCE"]
    assert train_id in table and "digits-val" in table
    listed = json.loads(ok(cli(env, "datasets", "list", "--json")))
    assert {d["id"] for d in listed} >= {train_id, val_id, shown["id"], registered["id"]}

    show = ok(cli(env, "datasets", "show", train_id))
    assert "images:   40" in show and "CLASS" in show
    assert json.loads(ok(cli(env, "datasets", "show", val_id, "--json")))["class_counts"]["7"] == 1

    ok(cli(env, "datasets", "delete", shown["id"]))
    fails(cli(env, "datasets", "show", shown["id"]), "NotFoundError")
    fails(cli(env, "datasets", "delete", "nope"), "NotFoundError")
    bad = cli(env, "datasets", "upload", str(tmp_path / "missing"))
    assert bad.returncode == 1 and "no such file or folder" in bad.stderr
    not_images = tmp_path / "not-images"
    (not_images / "a").mkdir(parents=True)
    (not_images / "a" / "x.txt").write_text("hello")
    (not_images / "b").mkdir()
    fails(cli(env, "datasets", "upload", str(not_images)), "InvalidDatasetError")


def test_submit_jobs_show_and_cancel(
    env: dict[str, str], live_server: LiveServer, digits: tuple[Path, Path], tmp_path: Path
) -> None:
    # One node with one unit: the first job is placed, the others wait in the queue.
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
        agent = FakeAgent(live_server.url, create_token(admin, "worker"), units=1)
    train_id, val_id = upload_both(env, digits)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: from-yaml\n"
        "model: {architecture: resnet18}\n"
        "train_dataset: digits-train\n"  # a name: resolved to the id by the client
        f"validation_dataset: {val_id}\n"
        "parameters: {epochs: 7, image_size: 32, augmentation: light}\n"
    )
    # the spec file, then the handy flags, then --set: the most explicit wins
    dry = json.loads(
        ok(
            cli(
                env,
                "submit",
                str(spec),
                "--epochs",
                "3",
                "--batch-size",
                "8",
                "--set",
                "parameters.epochs=4",
                "--set",
                "parameters.learning_rate=1e-3",
                "--lr",
                "0.5",
                "--dry-run",
            )
        )
    )
    assert dry["train_dataset"] == train_id
    assert dry["parameters"] == {
        "epochs": 4, "image_size": 32, "augmentation": "light", "batch_size": 8, "learning_rate": 0.001
    }  # fmt: skip
    job_id = ok(cli(env, "submit", str(spec), "--epochs", "2", "--name", "cli-job")).strip()
    job = json.loads(ok(cli(env, "show", job_id, "--json")))
    assert job["name"] == "cli-job" and job["status"] in ("queued", "scheduled")
    assert job["parameters"]["epochs"] == 2 and job["parameters"]["batch_size"] == 16  # defaults filled

    # JSON specs and flags alone work too
    json_spec = tmp_path / "job.json"
    json_spec.write_text(json.dumps({"model": {"architecture": "resnet18"}}))
    second = json.loads(
        ok(cli(env, "submit", str(json_spec), "--train", train_id, "--val", "digits-val", "--json"))
    )
    assert second["validation_dataset"] == val_id
    third = ok(cli(env, "submit", "--arch", "resnet34", "--train", train_id, "--val", val_id)).strip()

    table = ok(cli(env, "jobs"))
    assert table.splitlines()[0].split()[:3] == ["ID", "NAME", "STATUS"]
    assert job_id in table and second["id"] in table
    listed = json.loads(ok(cli(env, "jobs", "--status", "queued", "--status", "scheduled", "--json")))
    assert {j["id"] for j in listed} == {job_id, second["id"], third}
    shown = ok(cli(env, "show", second["id"]))
    assert "status:      queued" in shown and "history:" in shown
    assert "waiting:" in shown  # the reason it waits

    assert ok(cli(env, "cancel", third)).split() == [third, "cancelled"]
    assert ok(cli(env, "cancel", third)).split() == [third, "cancelled"]  # idempotent
    assert json.loads(ok(cli(env, "jobs", "--status", "cancelled", "--json")))[0]["id"] == third
    # a running job: cancelling, then cancelled once its (scripted) agent stopped the ranks
    placement = agent.claim()
    assert placement["job_id"] == job_id
    agent.status(placement, "running")
    assert ok(cli(env, "cancel", job_id)).split() == [job_id, "cancelling"]
    agent.status(placement, "cancelled")
    assert json.loads(ok(cli(env, "show", job_id, "--json")))["status"] == "cancelled"
    agent.close()

    # every API error is one line with its code and a non-zero exit
    line = fails(cli(env, "submit", str(spec), "--epochs", "0"), "ValidationError")
    assert "parameters.epochs" in line and "> 0" in line
    fails(cli(env, "submit", str(spec), "--set", "parameters.colour=red"), "ValidationError")
    fails(cli(env, "submit", str(spec), "--arch", "resnet9000"), "InvalidModelDirectoryError")
    fails(cli(env, "submit", str(spec), "--procs", "99"), "ResourceLimitError")
    fails(cli(env, "submit", str(spec), "--train", "no-such-dataset"), "NotFoundError")
    fails(cli(env, "show", "0" * 32), "NotFoundError")
    bad_set = cli(env, "submit", str(spec), "--set", "novalue")
    assert bad_set.returncode == 1 and "KEY=VALUE" in bad_set.stderr


def test_logs_metrics_and_cluster(
    env: dict[str, str], live_server: LiveServer, digits: tuple[Path, Path], agent: FakeAgent
) -> None:
    train_id, val_id = upload_both(env, digits)
    job_id = ok(cli(env, "submit", "--arch", "resnet18", "--train", train_id, "--val", val_id)).strip()

    follow = spawn_cli(env, "logs", job_id, "-f")
    watch = spawn_cli(env, "metrics", job_id, "--watch")
    time.sleep(1.5)
    assert follow.poll() is None, "logs -f ended before the job did"

    class Setup:  # what the scripted job runner needs
        pass

    setup: Any = Setup()
    setup.agent = agent
    text = scripted_run(setup, job_id)
    out, err = follow.communicate(timeout=60)
    assert follow.returncode == 0, err
    assert out == text  # everything, in order, and it ended with the job
    watched, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    lines = watched.strip().splitlines()
    # On a pipe too: a plain line for each status before the end (the end has its own).
    statuses = [line for line in lines if line.startswith(f"-- job {job_id} ")]
    assert [line.split()[3] for line in statuses] == ["queued", "scheduled", "running"], lines
    lines = [line for line in lines if line not in statuses]
    # Before the first epoch ends: the step it reached (one line, not one per point).
    assert lines[0].startswith("-- epoch 1/5  step 100  train.loss 0.0909"), lines
    assert sum(line.startswith("-- epoch") for line in lines) == 1
    lines = lines[1:]
    assert lines[0].split()[:2] == ["epoch", "train.loss"]
    assert [line.split()[0] for line in lines[1:3]] == ["1", "2"]
    assert lines[-1].startswith("status: failed")

    assert ok(cli(env, "logs", job_id)) == text
    assert ok(cli(env, "logs", job_id, "--rank", "0", "--offset", "6")) == text.encode()[6:].decode()
    fails(cli(env, "logs", job_id, "--rank", "5"), "ValidationError")
    table = ok(cli(env, "metrics", job_id)).splitlines()
    assert table[0].split() == ["epoch", "train.loss", "val.loss", "seconds"]
    assert [row.split()[0] for row in table[1:]] == ["1", "2"]
    points = json.loads(ok(cli(env, "metrics", job_id, "--json")))
    assert len(points) == 14 and {p["name"] for p in points} == {"train.loss", "val.loss", "epoch.seconds"}
    raw = ok(cli(env, "metrics", job_id, "--raw", "--name", "val.loss")).splitlines()
    assert raw[0].split()[:2] == ["SEQ", "NAME"] and len(raw) == 3

    cluster = ok(cli(env, "cluster"))
    assert "fake-node" in cluster and "NODE" in cluster
    nodes = json.loads(ok(cli(env, "cluster", "--json")))["nodes"]
    assert nodes[0]["name"] == "fake-node" and nodes[0]["units"] == 2


def test_download_resumes_and_verifies(
    env: dict[str, str], digits: tuple[Path, Path], agent: FakeAgent, tmp_path: Path
) -> None:
    train_id, val_id = upload_both(env, digits)
    job_id = ok(cli(env, "submit", "--arch", "resnet18", "--train", train_id, "--val", val_id)).strip()
    fails(cli(env, "download", job_id, "-o", str(tmp_path / "early")), "ModelNotReadyError")
    placement = agent.claim()
    agent.status(placement, "running")
    sha = agent.upload_model(placement, [str(i) for i in range(10)])
    agent.status(placement, "succeeded", exit_code=0)

    first = tmp_path / "first"
    result = cli(env, "download", job_id, "-o", str(first), "--keep-archive")
    assert ok(result).strip() == str(first)
    archive = tmp_path / "first.tar.gz"
    assert sha256_of(archive) == sha
    assert sorted(p.name for p in first.iterdir()) == [
        "SHA256SUMS",
        "config.json",
        "metrics.json",
        "model.safetensors",
    ]

    # An interrupted transfer left the first part of the archive: the download resumes it.
    second = tmp_path / "second"
    part = tmp_path / "second.tar.gz.part"
    data = archive.read_bytes()
    part.write_bytes(data[: len(data) // 3])
    result = cli(env, "download", job_id, "-o", str(second), "--json")
    assert json.loads(ok(result)) == {"job": job_id, "path": str(second), "sha256": sha, "verified": True}
    assert f"resuming the download at byte {len(data) // 3}" in result.stderr
    assert not part.exists() and not (tmp_path / "second.tar.gz").exists()
    for name in ("SHA256SUMS", "config.json", "metrics.json", "model.safetensors"):
        assert (second / name).read_bytes() == (first / name).read_bytes()

    # A part file that is not a prefix of the model is caught by the checksum and removed.
    third = tmp_path / "third"
    bad = tmp_path / "third.tar.gz.part"
    bad.write_bytes(b"x" * 1000)
    fails(cli(env, "download", job_id, "-o", str(third)), "InvalidModelDirectoryError")
    assert not bad.exists() and not third.exists()
    ok(cli(env, "download", job_id, "-o", str(third)))
    assert (third / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    # an existing non-empty target is refused, nothing is overwritten
    again = cli(env, "download", job_id, "-o", str(third))
    assert again.returncode == 1 and "not empty" in again.stderr

    # predict works on the downloaded directory, without the service (--json: see test_cli_training)
    images = sorted(str(p) for p in digits[1].glob("*/*.png"))[:3]
    shown = ok(
        cli({**env, "TORCHYARD_URL": "http://127.0.0.1:9"}, "predict", str(first), *images, "--topk", "2")
    )
    assert [line.split(": ")[0] for line in shown.splitlines()] == images
    assert all(re.fullmatch(r"\S+: \d \(\d+\.\d%\)  \d \(\d+\.\d%\)", line) for line in shown.splitlines())


def test_connection_and_auth_errors(live_server: LiveServer, settings: Settings, tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    # nothing listening: a clear message, exit code 3
    down = {**base, "TORCHYARD_URL": f"http://127.0.0.1:{free_port()}", "TORCHYARD_TOKEN": "x"}
    line = fails(cli(down, "jobs"), "ServiceUnreachableError", exit_code=3)
    assert "cannot reach the torchyard API" in line
    # a wrong token
    wrong = {**base, "TORCHYARD_URL": live_server.url, "TORCHYARD_TOKEN": "ty_wrong"}
    fails(cli(wrong, "jobs"), "AuthenticationError")
    # a local user never copies a token: the data directory's admin token is found
    local = {**base, "TORCHYARD_URL": live_server.url, "TORCHYARD_DATA_DIR": str(settings.data_dir)}
    assert ok(cli(local, "jobs")).startswith("ID")
    # ... and from ./torchyard-data when nothing is set
    shutil.copytree(
        settings.data_dir, tmp_path / "cwd" / "torchyard-data", ignore=shutil.ignore_patterns("*.db*")
    )
    assert ok(cli({**base, "TORCHYARD_URL": live_server.url}, "cluster", cwd=tmp_path / "cwd")).startswith(
        "nodes"
    )
    # flags win over the environment
    assert ok(cli(wrong, "jobs", "--token", live_server.admin_token, "--json")) == "[]\n"
    # a user token: another user's job is not found, worker routes are not its business
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token)) as admin:
        user = create_token(admin, "user")
        worker = create_token(admin, "worker")
    fails(cli({**wrong, "TORCHYARD_TOKEN": worker}, "jobs"), "PermissionDeniedError")
    assert ok(cli({**wrong, "TORCHYARD_TOKEN": user}, "datasets", "list", "--json")) == "[]\n"
