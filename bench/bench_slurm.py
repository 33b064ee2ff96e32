"""Submit → first training step, and images/s, of a torchyard job on Slurm against a bare
``sbatch`` + ``srun`` + ``torchrun`` of the same training on the same Slurm cluster (docs/slurm.md).

The cluster is the tests' private one (``tests.support.slurm_cluster``: Debian's slurmctld,
slurmd and munge, two nodes in network namespaces on this machine; root needed). The API
runs as ``torchyard serve`` with ``TORCHYARD_ENGINE=slurm`` (its default poll period).

* **torchyard**: ``POST /v1/jobs`` (2 nodes × 1 process), then everything a job pays: the
  API's pass and ``sbatch``, Slurm's scheduling, ``srun`` of the launcher on each node, its
  check-in, the dataset download, ``torchrun`` in the run's sandbox, the trainer. *First
  step* is the time of the first ``train.loss`` point (the rank's own clock) after the
  submission; images/s the mean of the epoch-end ``train.images_per_sec`` after epoch 1.
* **bare**: ``sbatch -N 2 --ntasks-per-node=1 --gres=gpu:1`` of a script that ``srun``s
  ``torchrun`` of ``bench/plain_torchrun.py`` (the same model, data, batch, image size,
  learning rate, "light" augmentation and epochs; 1 thread and 1 loader worker per rank, as
  the job's ranks get from the CPU Slurm allocates them). *First step* is the time rank 0
  prints after its first optimizer step; images/s its mean after epoch 1.

Rounds alternate bare and torchyard (``--repeats``). Every process is stopped at the end.

    python bench/bench_slurm.py                      # resnet18, 32 px, 2 epochs, 1 round
    python bench/bench_slurm.py --repeats 3 --epochs 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

# The tests' private Slurm cluster and API process are reused: the repository root first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.api_process import ApiProcess
from tests.support.factories import auth
from tests.support.slurm_cluster import SlurmCluster, slurm_unavailable
from tests.support.worker_fixtures import upload_digits, user_client

PLAIN = Path(__file__).resolve().parent / "plain_torchrun.py"


def bare_run(cluster: SlurmCluster, args: argparse.Namespace, data: Path, out: Path) -> tuple[float, float]:
    """One bare sbatch + srun + torchrun run: (seconds from sbatch to the first step, images/s)."""
    plain = [
        sys.executable, str(PLAIN), "--data", str(data), "--arch", args.arch, "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--image-size", str(args.image_size), "--lr", str(args.lr),
        "--workers", "1",
    ]  # fmt: skip
    script = out / "bare.sh"
    script.write_text(
        "#!/bin/sh\n"
        'MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)\n'
        "exec srun --ntasks-per-node=1 sh -c 'OMP_NUM_THREADS=1 exec "
        f"{sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 "
        f"--node-rank $SLURM_NODEID --master-addr "
        "'"
        "$MASTER"
        "'"
        " --master-port 29411 "
        f"{shlex.join(plain[1:])}'\n",
        encoding="utf-8",
    )
    log = out / f"bare-{time.time_ns()}.out"
    submitted = time.time()
    slurm_id = cluster.command(
        "sbatch", "--parsable", "-p", "low", "-N", "2", "--ntasks-per-node=1", "--gres=gpu:1",
        f"--output={log}", "--export=ALL", str(script),
    ).strip()  # fmt: skip
    deadline = time.monotonic() + args.timeout
    while cluster.active(""):
        if time.monotonic() > deadline:
            cluster.command("scancel", slurm_id, check=False)
            raise RuntimeError(f"bare run not done within {args.timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    text = log.read_text(errors="replace")
    first = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("first step done at")
    ]
    rate = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("plain images/sec:")
    ]
    if not first or not rate:
        raise RuntimeError(f"the bare run printed no first step or rate:\n{text[-3000:]}")
    return first[0] - submitted, rate[0]


def torchyard_run(
    user: httpx.Client, args: argparse.Namespace, digits: tuple[str, str]
) -> tuple[float, float]:
    """One torchyard job: (seconds from POST /v1/jobs to the first step, images/s)."""
    body = {
        "name": "bench-slurm",
        "model": {"architecture": args.arch},
        "train_dataset": digits[0],
        "validation_dataset": digits[1],
        "parameters": {
            "epochs": args.epochs, "batch_size": args.batch_size, "image_size": args.image_size,
            "learning_rate": args.lr, "augmentation": "light", "print_frequency": 1,
        },
        "resources": {"node_count": 2, "process_count_per_node": 1, "max_restarts": 0},
    }  # fmt: skip
    submitted = time.time()
    r = user.post("/v1/jobs", json=body)
    r.raise_for_status()
    job_id = r.json()["id"]
    deadline = time.monotonic() + args.timeout
    while (job := user.get(f"/v1/jobs/{job_id}").json())["status"] not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        if time.monotonic() > deadline:
            user.post(f"/v1/jobs/{job_id}/cancel")
            raise RuntimeError(f"job {job_id} not done within {args.timeout} s: {job}")
        time.sleep(0.5)
    if job["status"] != "succeeded":
        raise RuntimeError(f"job {job_id} {job['status']}: {job.get('failure')}")
    points = _metrics(user, job_id, "train.loss")
    first = min(datetime.fromisoformat(p["time"]).timestamp() for p in points if p["step"] == 1)
    losses = _metrics(user, job_id, "val.loss")
    ends = {p["step"] for p in losses}
    rates = [p["value"] for p in _metrics(user, job_id, "train.images_per_sec") if p["step"] in ends]
    steady = rates[1:] or rates
    return first - submitted, sum(steady) / len(steady)


def _metrics(user: httpx.Client, job_id: str, name: str) -> list[dict[str, Any]]:
    r = user.get(f"/v1/jobs/{job_id}/metrics", params={"name": name, "limit": 10000})
    r.raise_for_status()
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--per-class", type=int, default=60, help="digits per class (before the split)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the API's, Slurm's and the runs' files here"
    )
    args = parser.parse_args()
    why = slurm_unavailable()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="bench-slurm-", dir=os.environ.get("TMPDIR")) as tmp:
        root = args.keep.resolve() if args.keep else Path(tmp)
        cluster = SlurmCluster(root=root / "cluster").start()
        launcher = root / "launcher.sh"
        launcher.write_text(f'#!/bin/sh\nexec {sys.executable} -m worker.agent.placement_launcher "$@"\n')
        launcher.chmod(0o755)
        api = ApiProcess(
            root / "data", None, host=cluster.gateway,
            settings={
                "TORCHYARD_ENGINE": "slurm", "TORCHYARD_SLURM_PARTITIONS": "low",
                "TORCHYARD_SLURM_LAUNCHER": str(launcher), "TORCHYARD_SLURM_WORK_DIR": str(root / "nodes"),
                "SLURM_CONF": str(cluster.conf),
            },
        )  # fmt: skip
        api.env["TORCHYARD_SLURM_API_URL"] = api.url
        rows = []
        try:
            api.start().wait_ready()
            with httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60) as admin:
                user = user_client(admin, api.url)
            digits = upload_digits(user, root / "digits", per_class=args.per_class, size=args.image_size)
            for i in range(1, args.repeats + 1):
                load = os.getloadavg()[0]
                bare = bare_run(cluster, args, root / "digits", root)
                job = torchyard_run(user, args, digits)
                rows.append((i, bare, job, load, os.getloadavg()[0]))
                print(f"round {i}: bare {bare[0]:.2f} s, {bare[1]:.1f} img/s; torchyard {job[0]:.2f} s, "
                      f"{job[1]:.1f} img/s; load {load:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
            user.close()
        finally:
            api.kill()
            cluster.close()

    print(
        f"\n{args.arch} at {args.image_size} px, batch {args.batch_size}, {args.epochs} epochs, 2 nodes x 1 process\n"
    )
    print(
        "| round | bare: submit → first step | torchyard | ratio | bare img/s | torchyard img/s | ratio | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, bare, job, before, after in rows:
        print(f"| {i} | {bare[0]:.2f} s | {job[0]:.2f} s | {job[0] / bare[0]:.2f} | {bare[1]:.1f} | {job[1]:.1f} "
              f"| {job[1] / bare[1]:.3f} | {before:.1f} → {after:.1f} |")  # fmt: skip
    if len(rows) > 1:
        mb = statistics.median(r[1][0] for r in rows)
        mj = statistics.median(r[2][0] for r in rows)
        rb = statistics.median(r[1][1] for r in rows)
        rj = statistics.median(r[2][1] for r in rows)
        print(f"| median | {mb:.2f} s | {mj:.2f} s | {mj / mb:.2f} | {rb:.1f} | {rj:.1f} | {rj / rb:.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
