"""Checkpoint cost per epoch for the demo's ResNet-18 (SPEC §8).

``python bench/bench_checkpoint.py`` — the demo's setup: resnet18 for the 10 digit
classes at 32 px, batch 32, 1,438 training images over 2 processes (22 steps per
process per epoch), one compute thread per process. It measures, in one process:

* the epoch: 22 real training steps (forward, backward, SGD with momentum) on
  random 32 px images — without data loading, so it is shorter than a real epoch and
  the cost below is an upper bound;
* the checkpoint as the trainer writes it (model, optimizer, scheduler, early
  stopping, best model, the random states of 2 ranks): its size and the time rank 0
  spends writing it (the only part training waits for);
* the upload to a real local API (``torchyard serve`` on loopback, SQLite) by the
  agent's own uploader (:class:`worker.agent.checkpoints.CheckpointUploader`), and the
  epoch time while that upload runs in a thread beside the training (in production it
  runs in the agent, another process, so this contention is an upper bound too).

Cost per epoch = (write time + extra epoch time during the upload) / epoch time.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import torchvision
from bench_followers import LEASE, ScriptedWorker, Service, upload_tiny_datasets

from worker.agent.checkpoints import CheckpointUploader
from worker.trainer import checkpoint as ckpt
from worker.trainer import rng_state

STEPS = 22
BATCH = 32


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    images = torch.rand(BATCH, 3, 32, 32)
    labels = torch.randint(0, 10, (BATCH,))
    model.train()
    started = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return time.perf_counter() - started


def checkpoint_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int
) -> dict[str, object]:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ranks = [{"rng": rng_state.capture(), "meter": [0.0, 0.0, 0.0, 0.0]} for _ in range(2)]
    return {
        "job_id": "bench",
        "architecture": "resnet18",
        "classes": [str(i) for i in range(10)],
        "world_size": 2,
        "epoch": epoch,
        "step_in_epoch": 0,
        "step": epoch * STEPS,
        "sampler_epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "early_stopping": {"best_loss": 1.0, "best_epoch": epoch - 1, "epochs_without_improvement": 1},
        "best_metric": 1.0,
        "best_epoch": epoch - 1,
        # The worst case: the best epoch is not the current one, so both sets of weights are kept.
        "best_model": copy.deepcopy(model.state_dict()),
        "history": [{"epoch": e, "val.loss": 1.0} for e in range(1, epoch + 1)],
        "stopped": False,
        "rank_states": ranks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="checkpoints written and uploaded (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    train_steps(model, optimizer, 2)  # warm-up; momentum buffers exist from here on

    service = Service(None)
    try:
        admin = httpx.Client(
            base_url=service.url, headers={"Authorization": f"Bearer {service.admin_token}"}, timeout=60
        )
        worker = ScriptedWorker(service, admin)  # a node first: a job must fit the cluster
        train, val = upload_tiny_datasets(admin, Path(service.tmp.name) / "digits")
        spec = {
            "name": "bench-checkpoint",
            "model": {"architecture": "resnet18"},
            "train_dataset": train,
            "validation_dataset": val,
            "resources": {"node_count": 1, "process_count_per_node": 1},
        }
        submitted = admin.post("/v1/jobs", json=spec)
        submitted.raise_for_status()
        job_id = submitted.json()["id"]
        placement = worker.http.post("/v1/worker/nodes/bench-node/claim", params={"wait": 10}).json()
        worker.lease = lease = placement["lease_token"]
        worker.http.post(
            "/v1/worker/placements/status", json={"state": "running"}, headers={LEASE: lease}
        ).raise_for_status()

        run_dir = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
        rows = []
        for epoch in range(1, args.epochs + 1):
            alone = train_steps(model, optimizer, STEPS)
            started = time.perf_counter()
            info = ckpt.save_checkpoint(
                run_dir / ckpt.CHECKPOINT_FILE, checkpoint_state(model, optimizer, epoch)
            )
            write = time.perf_counter() - started
            uploader = CheckpointUploader(worker.http, job_id, lease, run_dir)
            beside: list[float] = []

            def train_beside(out: list[float] = beside) -> None:
                out.append(train_steps(model, optimizer, STEPS))

            trainer = threading.Thread(target=train_beside)
            trainer.start()
            uploader.start()
            uploader.stop(timeout=600)
            trainer.join()
            upload = uploader.uploaded[-1].seconds
            rows.append((info["size_bytes"], write, upload, alone, beside[0]))
            print(
                f"epoch {epoch}: checkpoint {info['size_bytes'] / 2**20:.1f} MiB, write {write:.2f} s, "
                f"upload {upload:.2f} s, epoch {alone:.2f} s alone / {beside[0]:.2f} s during the upload"
            )
        size = rows[-1][0]
        write = statistics.median(r[1] for r in rows)
        upload = statistics.median(r[2] for r in rows)
        alone = statistics.median(r[3] for r in rows)
        during = statistics.median(r[4] for r in rows)
        cost = (write + max(0.0, during - alone)) / alone
        print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}")
        print(f"checkpoint size: {size} bytes ({size / 2**20:.1f} MiB)")
        print(f"write (rank 0, blocking): median {write:.3f} s")
        print(
            f"upload to the local API (background): median {upload:.3f} s ({size / 2**20 / upload:.0f} MiB/s)"
        )
        print(
            f"epoch ({STEPS} steps of {BATCH}): median {alone:.2f} s alone, {during:.2f} s during an upload"
        )
        print(f"checkpoint cost per epoch: {100 * cost:.1f} % of the epoch (goal < 5 %)")
        admin.post(f"/v1/jobs/{job_id}/cancel")
    finally:
        service.stop()


if __name__ == "__main__":
    main()
