"""Trainer throughput against a plain torchrun DDP script doing the same work (SPEC §7).

Writes the scikit-learn digits as an ImageDirectory, then runs, with torchrun and
the same process count, batch size, image size, model and epochs:

* ``bench/plain_torchrun.py`` (the baseline), and
* the trainer (``-m worker.trainer``) on a job.json as the worker agent writes it,

and prints the training images/sec of both side by side: the mean over the epochs
after the first (the first includes start-up) of all ranks' images over the epoch's
training time; the trainer's figure comes from its ``events.jsonl``. With
``--repeats N`` the two alternate N times, which evens out a noisy machine.

Usage::

    python bench/bench_trainer.py                       # nproc 2, 3 epochs, resnet18 at 32 px
    python bench/bench_trainer.py --nproc 4 --epochs 5 --batch-size 64 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from torchyard.sample_data import write_digits

REPO = Path(__file__).resolve().parents[1]


def _torchrun(nproc: int, threads: int) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
    ], env


def run_plain(args: argparse.Namespace, data: Path) -> float:
    command, env = _torchrun(args.nproc, args.threads)
    command += [
        str(REPO / "bench" / "plain_torchrun.py"),
        "--data",
        str(data),
        "--arch",
        args.arch,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--image-size",
        str(args.image_size),
        "--lr",
        str(args.lr),
        "--workers",
        str(args.workers),
    ]
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    found = re.search(r"plain images/sec: ([0-9.]+)", proc.stdout)
    if proc.returncode != 0 or not found:
        sys.exit(f"plain script failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return float(found.group(1))


def run_trainer(args: argparse.Namespace, data: Path, run_dir: Path) -> float:
    run_dir.mkdir(parents=True)
    classes = sorted(p.name for p in (data / "train").iterdir())
    job = {
        "job_id": "bench",
        "attempt_id": run_dir.name,
        "model": {"architecture": args.arch, "pretrained": False, "memory_efficient": False},
        "init_from_dir": None,
        "parameters": {
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "warmup_epochs": 0,
            "learning_rate": args.lr,
            "random_seed": 1,
            "patience": args.epochs,
            "print_frequency": 50,
            "image_size": args.image_size,
            "augmentation": "light",
        },
        "train_dir": str(data / "train"),
        "val_dir": str(data / "val"),
        "classes": classes,
        "datasets": None,
        "output_dir": str(run_dir),
        "loader_workers": args.workers,
    }
    (run_dir / "job.json").write_text(json.dumps(job))
    command, env = _torchrun(args.nproc, args.threads)
    command += ["-m", "worker.trainer", "--config", str(run_dir / "job.json")]
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # The epoch-end train.images_per_sec point is the one logged at the epoch's val.loss step.
    epoch_end = {(e["epoch"], e["step"]) for e in events if e.get("name") == "val.loss"}
    rates = [
        e["value"]
        for e in events
        if e.get("name") == "train.images_per_sec" and (e["epoch"], e["step"]) in epoch_end
    ]
    steady = rates[1:] or rates
    return sum(steady) / len(steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=None, help="OMP threads per rank (default: cpus / nproc)"
    )
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=0, help="loader workers per rank, both runs")
    parser.add_argument("--per-class", type=int, default=None, help="cap on digits per class (default: all)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.nproc)

    with tempfile.TemporaryDirectory(prefix="torchyard-bench-") as tmp:
        root = Path(tmp)
        train, _ = write_digits(root / "digits", per_class=args.per_class, size=args.image_size)
        n_train = sum(1 for _ in train.rglob("*.png"))
        print(
            f"{args.arch} at {args.image_size} px, batch {args.batch_size}/process, {args.nproc} processes x "
            f"{args.threads} threads, {args.workers} loader workers, {args.epochs} epochs of {n_train} images",
            flush=True,
        )
        plain, trainer = [], []
        for i in range(args.repeats):
            plain.append(run_plain(args, root / "digits"))
            trainer.append(run_trainer(args, root / "digits", root / f"run-{i}"))
            print(
                f"  round {i + 1}: plain {plain[-1]:8.1f}   trainer {trainer[-1]:8.1f} images/sec", flush=True
            )
    p, t = statistics.median(plain), statistics.median(trainer)
    print(f"{'':14}{'images/sec':>12}")
    print(f"{'plain torchrun':14}{p:12.1f}")
    print(f"{'torchyard':14}{t:12.1f}   ({(t / p - 1) * 100:+.1f} %)")


if __name__ == "__main__":
    main()
