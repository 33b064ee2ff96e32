"""``serve --with-worker``'s worker: started with ``-P`` in a folder of its own, which lies in
the data directory the user gave (an older serve's folder beside it is moved in)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from service.serving import LocalWorker, worker_dir
from torchyard.contract.jobspec import SANDBOX_HIDE_VARIABLE


def test_serve_starts_its_worker_with_P_and_names_its_data_directory_hidden(tmp_path: Path) -> None:
    data = tmp_path / "data"
    worker = LocalWorker(
        "http://127.0.0.1:1", "t", "n", 1, data / "worker", data / "logs" / "l.log", data_dir=data
    )
    command = worker.command()
    assert command[1:3] == ["-P", "-m"]
    assert command[command.index("--work-dir") + 1] == str(data / "worker")


def test_the_worker_folder_is_inside_the_data_directory_and_an_old_one_beside_it_moves_in(
    make_settings: Any, tmp_path: Path
) -> None:
    data = tmp_path / "td"
    settings = make_settings(data_dir=data)
    assert worker_dir(settings) == data.absolute() / "worker"
    old = tmp_path / "td-worker"
    (old / "datasets").mkdir(parents=True)
    (old / "node-n.key").write_text("key")
    assert worker_dir(settings) == data.absolute() / "worker"
    assert (data / "worker" / "node-n.key").read_text() == "key" and not old.exists()
    assert worker_dir(settings) == data.absolute() / "worker"  # once moved, it stays


def test_the_worker_is_told_to_hide_the_data_directory_besides_what_was_named(tmp_path: Path) -> None:
    data = tmp_path / "data"
    worker = LocalWorker(
        "http://127.0.0.1:1", "t", "n", 1, data / "worker", data / "logs" / "l.log", data_dir=data
    )
    env = worker.environment({"PATH": "/usr/bin", SANDBOX_HIDE_VARIABLE: "/srv/other"})
    assert env[SANDBOX_HIDE_VARIABLE] == os.pathsep.join(["/srv/other", str(data.absolute())])
    assert env["TORCHYARD_TOKEN"] == "t" and env["PATH"] == "/usr/bin"


def test_the_object_stores_credentials_never_reach_the_worker(tmp_path: Path) -> None:
    worker = LocalWorker("http://127.0.0.1:1", "t", "n", 1, tmp_path / "worker", tmp_path / "l.log")
    env = worker.environment(
        {
            "PATH": "/usr/bin",
            "AWS_ACCESS_KEY_ID": "AKIA",
            "AWS_SECRET_ACCESS_KEY": "secret",
            "AWS_SESSION_TOKEN": "session",
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
            "TORCHYARD_STORAGE_URL": "s3://bucket/prefix",
        }
    )
    assert sorted(env) == ["PATH", "TORCHYARD_TOKEN"]
