"""Object storage end to end (docs/storage.md): ``torchyard serve`` with its artifacts in a real
S3 server (SeaweedFS), real agents, real training.

A dataset upload, a training job preempted after a mid-epoch checkpoint and resumed from it
on another node, the model's download, and a script job's outputs: every artifact's bytes go
between the clients and the bucket with presigned URLs, and the API process moves none of
them (its own count of artifact bytes, and the bytes its process read and wrote).
"""

from __future__ import annotations

import hashlib
import signal
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api_process import ApiProcess
from tests.support.factories import auth
from tests.support.worker_fixtures import (
    AgentProcess,
    agent_log_of,
    start_agent,
    user_client,
    wait_for_job,
    wait_for_node,
    worker_token,
)
from torchyard.client import Client

pytestmark = pytest.mark.slow

SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
    "TORCHYARD_LEASE_TIMEOUT_S": "4",
    "TORCHYARD_REAPER_INTERVAL_S": "0.2",
    "TORCHYARD_MASTER_PORT_MIN": "27500",
    "TORCHYARD_MASTER_PORT_MAX": "27599",
    "TORCHYARD_ENV": "local",
}
OUTPUTS_SCRIPT = """
import os, pathlib
out = pathlib.Path("outputs")
out.mkdir(exist_ok=True)
(out / "result.txt").write_text("rank " + os.environ["RANK"] + " of " + os.environ["WORLD_SIZE"])
(out / "noise.bin").write_bytes(os.urandom(3_000_000))
"""


def _io(pid: int) -> int:
    """Bytes the process read and wrote through system calls (files, sockets, pipes)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


@dataclass
class StorageEnv:
    api: ApiProcess
    s3: Any
    bucket: str
    user: httpx.Client
    user_token: str
    worker: str
    tmp: Path
    agents: list[AgentProcess] = field(default_factory=list)

    def agent(self, name: str, **kw: Any) -> AgentProcess:
        agent = start_agent(self.api.url, self.worker, name, self.tmp / name, slots=2, **kw)
        self.agents.append(agent)
        wait_for_node(self.user, name, timeout=240)
        return agent

    def wait(self, job_id: str, predicate: Any = None, timeout: float = 400) -> dict[str, Any]:
        if predicate is None:
            return wait_for_job(self.user, job_id, timeout=timeout, agents=self.agents)
        return wait_for_job(self.user, job_id, predicate, timeout=timeout, agents=self.agents)

    def objects(self, prefix: str) -> dict[str, int]:
        pages = (
            self.s3.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=f"site/{prefix}")
        )
        return {
            item["Key"][len("site/") :]: item["Size"] for page in pages for item in page.get("Contents", [])
        }

    def moved(self) -> dict[str, int]:
        r = self.user.get("/v1/storage")
        assert r.status_code == 200, r.text
        assert r.json()["direct"] is True
        traffic: dict[str, int] = r.json()["api_artifact_bytes"]
        return traffic


@pytest.fixture
def env(s3_server: Any, tmp_path: Path) -> Iterator[StorageEnv]:
    bucket = s3_server.make_bucket()
    settings = {**SETTINGS, **s3_server.env(), "TORCHYARD_STORAGE_URL": f"s3://{bucket}/site"}
    api = ApiProcess(tmp_path / "data", None, settings=settings).start().wait_ready()
    admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60)
    user = user_client(admin, api.url)
    e = StorageEnv(
        api, s3_server, bucket, user, user.headers["Authorization"].split()[1], worker_token(admin), tmp_path
    )
    try:
        yield e
    finally:
        for agent in e.agents:
            agent.discard()
        user.close()
        admin.close()
        api.terminate()


def _wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.1)


def test_artifacts_go_between_clients_and_the_bucket_and_never_through_the_api(
    env: StorageEnv, tmp_path: Path
) -> None:
    from torchyard.sample_data import write_digits

    assert env.api.proc is not None
    api_pid = env.api.proc.pid
    client = Client(env.api.url, env.user_token)

    # A dataset upload: the client PUTs the archive to the bucket.
    train_dir, val_dir = write_digits(tmp_path / "digits", per_class=12, size=32)
    train = client.datasets.upload_dataset(train_dir, "digits-train")
    val = client.datasets.upload_dataset(val_dir, "digits-val")
    images = sum(1 for p in train_dir.rglob("*") if p.is_file())
    assert train.num_images == images and sorted(train.classes) == sorted(p.name for p in train_dir.iterdir())
    assert any(key.startswith("datasets/") for key in env.objects("datasets/"))

    # A training job preempted half-way through epoch 2 (after a checkpoint mid-epoch),
    # resumed on another node from that checkpoint, fetched from the bucket.
    first = env.agent(
        "cpu-1", grace_period=5, env={"TORCHYARD_PREEMPT_GRACE_S": "60", "TORCHYARD_TEST_PAUSE_AT": "train:2"}
    )
    spec = {
        "name": "digits-s3",
        "model": {"architecture": "squeezenet1_1"},
        "train_dataset": train.id,
        "validation_dataset": val.id,
        "parameters": {"epochs": 2, "batch_size": 16, "image_size": 32, "print_frequency": 1},
        "resources": {"node_count": 1, "process_count_per_node": 1},
    }
    r = env.user.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    env.wait(job_id, lambda j: j["status"] == "running", timeout=300)
    runs = sorted((first.work_dir / "runs").glob(f"{job_id}-*"))
    assert len(runs) == 1
    _wait_for_file(runs[0] / "paused-train-2", timeout=300)
    first.process.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    (runs[0] / "paused-train-2").unlink()
    assert first.process.wait(120) == 0, first.log_text()[-4000:]
    assert "checkpoint of epoch 1 step" in agent_log_of(runs[0]).read_text()
    checkpoints = env.objects("checkpoints/")
    assert checkpoints and all(key.startswith(f"checkpoints/{job_id}/") for key in checkpoints)

    second = env.agent("cpu-2")
    job = env.wait(job_id, timeout=400)
    assert job["status"] == "succeeded", job
    assert [a["status"] for a in job["attempts"]] == ["preempted", "succeeded"] and job["restarts"] == 0
    resumed = sorted((second.work_dir / "runs").glob(f"{job_id}-a2-*"))
    assert "resuming from it" in agent_log_of(resumed[0]).read_text()

    # The model: uploaded by node rank 0 to its own key, downloaded through a redirect.
    models = env.objects(f"models/{job_id}/")
    assert len(models) == 1
    r = env.user.get(f"/v1/jobs/{job_id}/model")
    assert r.status_code == 307 and r.headers["etag"] == f'"{job["model_sha256"]}"'
    before = _io(api_pid)
    model_dir = client.models.download_model(job_id, tmp_path / "model")
    assert (model_dir / "config.json").is_file()
    model_size = next(iter(models.values()))
    assert _io(api_pid) - before < model_size / 4, (_io(api_pid) - before, model_size)

    # A script job's outputs: its code uploaded to the bucket by the client, its outputs by
    # the agent, then downloaded from the bucket.
    source = tmp_path / "writer"
    source.mkdir()
    (source / "write.py").write_text(OUTPUTS_SCRIPT)
    code = client.code.upload_code(source, "writer")
    assert any(key.startswith("code/") for key in env.objects("code/"))
    script = {
        "type": "script",
        "code": code.id,
        "command": ["python", "write.py"],
        "resources": {"node_count": 1, "process_count_per_node": 1},
    }
    r = env.user.post("/v1/jobs", json=script)
    assert r.status_code == 201, r.text
    script_id = r.json()["id"]
    done = env.wait(script_id, timeout=300)
    assert done["status"] == "succeeded", done
    before = _io(api_pid)
    archive = client.code.download_outputs(script_id, tmp_path / "outputs.tar.gz")
    assert _io(api_pid) - before < 1_000_000, _io(api_pid) - before
    with tarfile.open(archive) as tf:
        files = {m.name.rsplit("/", 1)[-1]: tf.extractfile(m).read() for m in tf if m.isreg()}  # type: ignore[union-attr]
    assert files["result.txt"] == b"rank 0 of 1" and len(files["noise.bin"]) == 3_000_000
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == done["outputs_sha256"]

    # The API moved none of those bytes: its own count of artifact bytes in and out is 0,
    # and around each download above its process read and wrote a fraction of their size.
    assert env.moved() == {"received": 0, "sent": 0}
    assert sum(env.objects("").values()) > 8_000_000
