"""Checkpoint cost per epoch for the demo's ResNet-18 (docs/restarts.md).

``python bench/bench_checkpoint.py`` runs the demo's real training: the trainer
(``-m worker.trainer`` under torchrun, as the agent starts it) on scikit-learn's
handwritten digits (1,438 training and 359 validation images, written as PNG folders
and read by the trainer's own data loader), resnet18 from scratch at 32 px, batch 32,
lr 0.05 with one warm-up epoch, ``light`` augmentation, one process (``--nproc``, the
demo's ``--procs``) with OMP_NUM_THREADS = usable CPUs / processes and the trainer's
default loader workers, as the agent sets them. Each epoch is a real one: data
loading, training steps, validation.

Four runs of the same job, each in a fresh run directory:

* ``none``: no checkpoints at all (``TORCHYARD_BENCH_NO_CHECKPOINTS=1`` read by the test
  suite's trainer hooks, ``tests/support/trainer_hooks.py``): the baseline;
* ``write``: the checkpoint after every epoch (``TORCHYARD_CHECKPOINT_INTERVAL_S=0``),
  written by rank 0's background writer;
* ``write+upload``: the same, and the agent's own uploader
  (:class:`worker.agent.checkpoints.CheckpointUploader`, in this bench's process, so
  another process than the trainer, as in the agent) uploading each checkpoint to a
  real API (``torchyard serve`` on loopback, SQLite) while the next epoch trains;
* ``scheduled``: as ``write+upload`` with the trainer's default schedule (the first
  epoch end, then an interval of 80 times the last write, and the last epoch). Its
  figures: which epochs got a checkpoint, the total time of epochs 2..N against
  ``none`` and ``write+upload``, and the CPU its checkpoints take per epoch (the
  per-checkpoint CPU measured on the every-epoch runs).

Measured: the checkpoint's size; what training waits for (rank 0's log: gathering the
random states, copying the weights and optimizer state, and waiting for the previous
write); the background write time (serialise + sha256 + rename; no fsync); the upload
time; and the epoch time (the trainer's ``epoch.seconds``: training + validation) of
each run. Epoch 1 (start-up, warm-up) and the last epoch (no upload runs beside it)
are left out of the epoch medians.

Cost per epoch = (time training waits + epoch time of ``write+upload`` - epoch time of
``none``) / epoch time of ``none``. With ``--repeats N`` the three runs alternate N
times and the medians cover all of them (a noisy machine evens out).

Two CPU figures follow, which the noise in epoch times does not blur: the CPU the
node spends per checkpoint (training's wait, the writer thread, the agent's
uploader) over the epoch time of ``none`` (the API on other machines, as in
production), and the same plus the API's CPU for receiving it (the API on the
training's cores, as here). Where training keeps every core busy, each is an upper
bound of what the checkpoint costs per epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_followers import LEASE, ScriptedWorker, Service, upload_tiny_datasets

from torchyard.sample_data import write_digits
from worker.agent.checkpoints import CheckpointUploader, Uploaded
from worker.agent.node import usable_cpus
from worker.trainer.hooks import HOOKS_VAR

REPO = Path(__file__).resolve().parents[1]
# The test suite's trainer hooks: TORCHYARD_BENCH_NO_CHECKPOINTS=1 turns the checkpoints off there.
TRAINER_HOOKS = REPO / "tests" / "support" / "trainer_hooks.py"
VARIANTS = ("none", "write", "write+upload", "scheduled")
# The variants that write after every epoch (TORCHYARD_CHECKPOINT_INTERVAL_S=0).
EVERY_EPOCH = ("write", "write+upload")
_WAITED = re.compile(r"checkpoint after epoch (\d+) handed to the writer: training waited ([\d.]+)s")
_WRITTEN = re.compile(
    r"checkpoint after epoch (\d+) written in the background: (\d+) bytes in ([\d.]+)s \(([\d.]+)s CPU\)"
)


@dataclass
class Run:
    variant: str
    epoch_seconds: dict[int, float]
    waited: dict[int, float] = field(default_factory=dict)
    # epoch: (bytes, seconds, CPU seconds of the writer thread)
    written: dict[int, tuple[int, float, float]] = field(default_factory=dict)
    uploaded: list[Uploaded] = field(default_factory=list)
    wall: float = 0.0
    server_cpu: float = 0.0  # CPU seconds of the API process during the run


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _job(run_dir: Path, train: Path, val: Path, epochs: int) -> Path:
    """``job.json`` as the agent writes it, with the demo's parameters."""
    job = {
        "job_id": "job-bench-checkpoint",
        "attempt_id": "attempt-1",
        "model": {"architecture": "resnet18", "pretrained": False, "memory_efficient": False},
        "init_from_dir": None,
        "parameters": {
            "epochs": epochs,
            "batch_size": 32,
            "warmup_epochs": 1,
            "learning_rate": 0.05,
            "random_seed": 1,
            "patience": max(3, epochs),
            "print_frequency": 5,
            "image_size": 32,
            "augmentation": "light",
        },
        "train_dir": str(train),
        "val_dir": str(val),
        "classes": [str(i) for i in range(10)],
        "datasets": {
            "train": {"id": "ds-train", "sha256": "0" * 64},
            "validation": {"id": "ds-val", "sha256": "1" * 64},
        },
        "output_dir": str(run_dir),
        "loader_workers": None,
    }
    path = run_dir / "job.json"
    path.write_text(json.dumps(job, indent=2), encoding="utf-8")
    return path


def run_trainer(
    variant: str,
    run_dir: Path,
    digits: tuple[Path, Path],
    args: argparse.Namespace,
    uploader: CheckpointUploader | None,
    server_pid: int,
) -> Run:
    run_dir.mkdir(parents=True)
    job = _job(run_dir, digits[0], digits[1], args.epochs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(max(1, usable_cpus() // args.nproc)),
            "TORCHYARD_NODE_NAME": "bench-node",
            "TORCHYARD_DEVICE": "cpu",
        }
    )
    if variant == "none":
        env[HOOKS_VAR] = str(TRAINER_HOOKS)
        env["TORCHYARD_BENCH_NO_CHECKPOINTS"] = "1"
    elif variant in EVERY_EPOCH:
        env["TORCHYARD_CHECKPOINT_INTERVAL_S"] = "0"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += [str(args.nproc), "-m", "worker.trainer", "--config", str(job)]
    log_path = run_dir / "trainer.log"
    if uploader is not None:
        uploader.start()
    server_cpu = _cpu_of(server_pid)
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    if uploader is not None:
        uploader.stop(timeout=600)
    server_cpu = _cpu_of(server_pid) - server_cpu
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if code != 0:
        raise SystemExit(f"the {variant} run failed ({code}):\n{text[-4000:]}")
    epochs = {}
    for line in (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        if event.get("type") == "metric" and event.get("name") == "epoch.seconds":
            epochs[int(event["epoch"])] = float(event["value"])
    run = Run(variant, epochs, wall=wall, server_cpu=server_cpu)
    run.waited = {int(m[1]): float(m[2]) for m in _WAITED.finditer(text)}
    run.written = {int(m[1]): (int(m[2]), float(m[3]), float(m[4])) for m in _WRITTEN.finditer(text)}
    run.uploaded = list(uploader.uploaded) if uploader is not None else []
    if variant in EVERY_EPOCH and len(run.written) != args.epochs:
        raise SystemExit(f"the {variant} run logged {len(run.written)} checkpoint(s), not {args.epochs}")
    return run


def _middle(run: Run, last: int) -> list[float]:
    """Epoch times of epochs 2..last-1: after start-up, each with a checkpoint of the epoch
    before being written (and uploaded) beside it."""
    return [s for e, s in run.epoch_seconds.items() if 1 < e < last]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="epochs per run (default 5, at least 3)")
    parser.add_argument("--nproc", type=int, default=1, help="training processes (default 1, the demo's)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three runs (default 1)")
    args = parser.parse_args()
    if args.epochs < 3:
        parser.error("--epochs must be at least 3 (epoch 1 and the last are left out)")

    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    train, val = write_digits(root / "digits", size=32)
    print(f"load average at the start: {os.getloadavg()[0]:.2f} (1 min)")
    print(
        f"digits: {sum(1 for _ in train.rglob('*.png'))} training, {sum(1 for _ in val.rglob('*.png'))} "
        f"validation images; resnet18, 32 px, batch 32, {args.nproc} process(es), {args.epochs} epochs"
    )
    service = Service(None)
    runs: list[Run] = []
    try:
        admin = httpx.Client(
            base_url=service.url, headers={"Authorization": f"Bearer {service.admin_token}"}, timeout=60
        )
        worker = ScriptedWorker(service, admin)  # a node first: a job must fit the cluster
        train_id, val_id = upload_tiny_datasets(admin, Path(service.tmp.name) / "digits")
        spec = {
            "name": "bench-checkpoint",
            "model": {"architecture": "resnet18"},
            "train_dataset": train_id,
            "validation_dataset": val_id,
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

        for round_ in range(1, args.repeats + 1):
            for variant in VARIANTS:
                run_dir = root / f"run-{round_}-{variant.replace('+', '-')}"
                uploader = None
                if variant in ("write+upload", "scheduled"):
                    uploader = CheckpointUploader(worker.http, job_id, lease, run_dir)
                run = run_trainer(variant, run_dir, (train, val), args, uploader, service.process.pid)
                runs.append(run)
                epochs = ", ".join(f"{run.epoch_seconds[e]:.2f}" for e in sorted(run.epoch_seconds))
                print(f"round {round_} {variant}: epoch seconds {epochs} (run {run.wall:.1f} s)")
                for epoch in sorted(run.written):
                    size, write, write_cpu = run.written[epoch]
                    ups = [u for u in run.uploaded if u.epoch == epoch]
                    upload = (
                        f", upload {ups[0].seconds:.2f} s ({ups[0].cpu_seconds:.2f} s CPU)" if ups else ""
                    )
                    print(
                        f"  checkpoint {epoch}: {size / 2**20:.1f} MiB, training waited "
                        f"{run.waited.get(epoch, float('nan')):.3f} s, write {write:.2f} s "
                        f"({write_cpu:.2f} s CPU, background){upload}"
                    )
        admin.post(f"/v1/jobs/{job_id}/cancel")
    finally:
        service.stop()
        shutil.rmtree(root, ignore_errors=True)
    summarize(runs, args)


def summarize(runs: list[Run], args: argparse.Namespace) -> None:
    by = {v: [r for r in runs if r.variant == v] for v in VARIANTS}
    epoch = {v: statistics.median(s for r in by[v] for s in _middle(r, args.epochs)) for v in EVERY_EPOCH}
    epoch["none"] = statistics.median(s for r in by["none"] for s in _middle(r, args.epochs))
    checkpointed = by["write"] + by["write+upload"]
    waited = statistics.median(w for r in checkpointed for w in r.waited.values())
    writes = [w for r in checkpointed for (_, w, _) in r.written.values()]
    write_cpu = statistics.median(c for r in checkpointed for (_, _, c) in r.written.values())
    sizes = [size for r in checkpointed for (size, _, _) in r.written.values()]
    uploads = [u for r in by["write+upload"] for u in r.uploaded]
    upload = statistics.median(u.seconds for u in uploads)
    upload_cpu = statistics.median(u.cpu_seconds for u in uploads)
    upload_bytes = statistics.median(u.size for u in uploads)
    # The API's CPU for receiving and storing the uploads: the run with them minus the one without.
    server_cpu = max(
        0.0,
        statistics.median(r.server_cpu for r in by["write+upload"])
        - statistics.median(r.server_cpu for r in by["write"]),
    ) / max(1, statistics.median(len(r.uploaded) for r in by["write+upload"]))
    extra = epoch["write+upload"] - epoch["none"]
    cost = (waited + max(0.0, extra)) / epoch["none"]
    cpu_cost = (waited + write_cpu + upload_cpu + server_cpu) / epoch["none"]
    print()
    print(f"machine: {platform.machine()}, {usable_cpus()} usable CPU(s), load {os.getloadavg()[0]:.2f} now")
    print(
        f"checkpoint size: {min(sizes):,} to {max(sizes):,} bytes ({min(sizes) / 2**20:.1f} to "
        f"{max(sizes) / 2**20:.1f} MiB; the best epoch's weights are stored apart only when it is "
        "not the current one)"
    )
    print(f"training waits per checkpoint: median {waited:.3f} s")
    print(f"write in the background: median {statistics.median(writes):.2f} s ({write_cpu:.2f} s CPU)")
    print(
        f"upload to the local API (agent's uploader, background): median {upload:.2f} s "
        f"({upload_bytes / 2**20 / upload:.0f} MiB/s; {upload_cpu:.2f} s CPU in the uploader, "
        f"{server_cpu:.2f} s in the API)"
    )
    print(
        "epoch (training + validation), median of epochs 2..N-1: "
        + ", ".join(f"{v} {epoch[v]:.2f} s" for v in ("none", *EVERY_EPOCH))
    )
    print(
        f"checkpoint cost per epoch: ({waited:.3f} s waited + {extra:+.2f} s epoch time) / "
        f"{epoch['none']:.2f} s = {100 * cost:.1f} % (goal < 5 %)"
    )
    node_cost = (waited + write_cpu + upload_cpu) / epoch["none"]
    print(
        f"CPU the node spends per epoch (the API elsewhere): ({waited:.3f} waited + {write_cpu:.2f} write + "
        f"{upload_cpu:.2f} upload) / {epoch['none']:.2f} s = {100 * node_cost:.1f} %"
    )
    print(
        f"CPU taken per epoch (upper bound where training uses every core): ({waited:.3f} waited + "
        f"{write_cpu:.2f} write + {upload_cpu:.2f} upload + {server_cpu:.2f} API) / "
        f"{epoch['none']:.2f} s = {100 * cpu_cost:.1f} %"
    )

    _summarize_schedule(by, args, waited + write_cpu + upload_cpu + server_cpu)


def _after_first(run: Run) -> float:
    """Total time of epochs 2..N (each may have the previous epoch's checkpoint beside it)."""
    return sum(s for e, s in run.epoch_seconds.items() if e > 1)


def _summarize_schedule(
    by: dict[str, list[Run]], args: argparse.Namespace, cpu_per_checkpoint: float
) -> None:
    """The default schedule: which epochs got a checkpoint, and what they cost over the run."""
    scheduled = by["scheduled"]
    for run in scheduled:
        print(f"scheduled: checkpoints after epochs {sorted(run.written)} of {args.epochs}")
    # Checkpoints written beside training: every one but the last epoch's.
    beside = statistics.median(len([e for e in r.written if e < args.epochs]) for r in scheduled)
    none = statistics.median(_after_first(r) for r in by["none"])
    every = statistics.median(_after_first(r) for r in by["write+upload"])
    spaced = statistics.median(_after_first(r) for r in scheduled)
    epochs = args.epochs - 1
    print(
        f"epochs 2..{args.epochs}, total (median of rounds): none {none:.1f} s, every epoch {every:.1f} s "
        f"({100 * (every - none) / none:+.1f} %), scheduled {spaced:.1f} s ({100 * (spaced - none) / none:+.1f} %)"
    )
    print(
        f"scheduled, CPU taken per epoch (upper bound, the API on the training's cores): {beside:g} "
        f"checkpoint(s) beside training x {cpu_per_checkpoint:.2f} s / ({epochs} epochs x "
        f"{none / epochs:.2f} s) = {100 * beside * cpu_per_checkpoint / none:.1f} % "
        f"(every epoch: {100 * (args.epochs - 1) * cpu_per_checkpoint / none:.1f} %)"
    )


if __name__ == "__main__":
    main()
