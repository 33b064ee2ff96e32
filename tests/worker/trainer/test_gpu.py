"""The CUDA path end to end: ``torchyard serve`` + one ``torchyard worker`` that discovers the GPU.

Needs a CUDA GPU; skipped without one. Run with::

    .venv/bin/python -m pytest -m gpu tests/worker/trainer/test_gpu.py

The API and the agent are real processes (SQLite in a temporary data directory); the
digits are uploaded through the API and trained on the GPU (NCCL, bf16 autocast,
channels_last) at 32 px and at 224 px; the downloaded model, evaluated on the CPU in
float32, must agree with what the job reported.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import free_port
from tests.support.factories import auth, job_spec
from tests.support.worker_fixtures import (
    upload_digits,
    user_client,
    wait_for_job,
    wait_for_node,
    worker_token,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)"),
]

NODE = "gpu-0"
# bf16 on the GPU against float32 on the CPU may flip a near-tie: at most 1 % of the images.
TOP1_TOLERANCE = 0.01


@dataclass
class Service:
    url: str
    root: Path
    user: httpx.Client
    processes: list[subprocess.Popen[bytes]]
    agent_log: Path

    def submit(self, train: str, val: str, image_size: int, **resources: int) -> str:
        spec = job_spec(
            train,
            val,
            name=f"gpu-digits-{image_size}",
            parameters={
                "epochs": 3,
                "batch_size": 64,
                "image_size": image_size,
                "augmentation": "light",
                "learning_rate": 0.05,
                "print_frequency": 5,
            },
            resources={"node_count": 1, "process_count_per_node": 1, **resources},
        )
        r = self.user.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        return job_id


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("gpu")
    data_dir = root / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "TORCHYARD_DATA_DIR": str(data_dir),
        "TORCHYARD_DATABASE_URL": f"sqlite:///{root / 'torchyard.db'}",
        # These jobs measure GPU decoding, which the decoded-image cache replaces (docs/gpu.md).
        "TORCHYARD_IMAGE_CACHE": "0",
    }
    env.pop("TORCHYARD_TOKEN", None)
    processes = [
        _start([sys.executable, "-m", "torchyard.cli", "serve", "--port", str(port)], env, root / "api.log")
    ]
    admin_token_path = data_dir / "admin.token"
    deadline = time.monotonic() + 120
    while True:
        try:
            if admin_token_path.exists() and httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert processes[0].poll() is None, (root / "api.log").read_text()
        assert time.monotonic() < deadline, "torchyard serve did not start"
        time.sleep(0.2)
    admin = httpx.Client(base_url=url, headers=auth(admin_token_path.read_text().strip()), timeout=60)
    user = user_client(admin, url, "gpu-user")
    agent_env = {**env, "TORCHYARD_TOKEN": worker_token(admin, "gpu-agents")}
    agent_log = root / "agent.log"
    # No --cpu and no --slots: the agent must find the GPUs itself.
    processes.append(
        _start(
            [
                sys.executable,
                "-m",
                "torchyard.cli",
                "worker",
                "--api",
                url,
                "--name",
                NODE,
                "--work-dir",
                str(root / "work"),
            ],
            agent_env,
            agent_log,
        )
    )
    wait_for_node(user, NODE, timeout=120)
    try:
        yield Service(url, root, user, processes, agent_log)
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        user.close()
        admin.close()


def test_the_agent_registers_every_visible_gpu(service: Service) -> None:
    nodes = {n["name"]: n for n in service.user.get("/v1/cluster").json()["nodes"]}
    node = nodes[NODE]
    assert node["units"] == torch.cuda.device_count(), node
    assert node["accelerator"].startswith("cuda:"), node
    assert torch.cuda.get_device_name(0)[:20] in node["accelerator"], node


def test_more_processes_than_gpus_is_refused_at_submission(service: Service) -> None:
    train, val = upload_digits(service.user, service.root / "digits-small", per_class=5)
    r = service.user.post(
        "/v1/jobs",
        json=job_spec(
            train, val, resources={"node_count": 1, "process_count_per_node": torch.cuda.device_count() + 1}
        ),
    )
    assert r.status_code == 422, r.text
    assert "process_count_per_node" in r.text


def _upload_photos(service: Service, root: Path) -> tuple[str, str]:
    from tests.support.worker_fixtures import upload_dataset
    from torchyard.sample_data import write_photos

    train_dir, val_dir = write_photos(root, classes=10, train_per_class=60, val_per_class=20, workers=4)
    return upload_dataset(service.user, train_dir, "photos-train")["id"], upload_dataset(
        service.user, val_dir, "photos-val"
    )["id"]


@pytest.mark.parametrize(
    ("data", "image_size"),
    [("digits", 32), ("digits", 224), ("photos", 96)],
    ids=["digits-png-32px", "digits-png-224px", "photos-jpeg-96px"],
)
def test_a_job_trains_on_the_gpu_and_its_model_agrees_on_the_cpu(
    service: Service, data: str, image_size: int
) -> None:
    folder = service.root / f"{data}-{image_size}"
    if data == "digits":
        train, val = upload_digits(service.user, folder, per_class=200, size=image_size)
    else:
        train, val = _upload_photos(service, folder)
    job_id = service.submit(train, val, image_size)
    job = wait_for_job(service.user, job_id, timeout=600)
    assert job["status"] == "succeeded", f"{job}\n{service.agent_log.read_text()[-6000:]}"
    assert job["nodes"] == [NODE]

    points = service.user.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()["items"]
    names = {p["name"] for p in points}
    assert names >= {"train.loss", "train.lr", "train.images_per_sec", "val.loss", "val.top1", "val.top5"}
    rates = [p["value"] for p in points if p["name"] == "train.images_per_sec"]
    assert rates and min(rates) > 0

    # The rank really ran on CUDA with NCCL.
    log = service.user.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text
    assert "backend nccl" in log and "device cuda:0" in log, log[-3000:]
    # JPEG training images are decoded on the GPU; the PNG digits by the loader workers.
    decoded_on_gpu = "training images decoded on the GPU" in log
    assert decoded_on_gpu == (data == "photos"), log[-3000:]

    r = service.user.get(f"/v1/jobs/{job_id}/model")
    assert r.status_code == 200 and r.headers["etag"].strip('"') == job["model_sha256"]
    dest = service.root / f"model-{data}-{image_size}"
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tf:
        tf.extractall(dest, filter="data")
    model_dir = next(p.parent for p in dest.rglob("config.json"))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["device"] == "cuda" and config["mixed_precision"] == "bf16", config
    assert config["image_size"] == image_size

    from torchyard.modeldir import evaluate_dir

    result = evaluate_dir(model_dir, folder / "val", device="cpu")
    reported = job["best"]["val.top1"]
    assert result["top1"] == pytest.approx(reported, abs=TOP1_TOLERANCE), (result, job["best"])
    # A trained model, not chance (10 classes).
    assert reported > 0.5, job["best"]
    print(
        f"\n{data} at {image_size} px on {torch.cuda.get_device_name(0)}: val.top1 {reported:.4f} on the GPU, "
        f"{result['top1']:.4f} on the CPU; {max(rates):.0f} images/s"
    )
