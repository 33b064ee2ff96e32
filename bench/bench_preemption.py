"""Preemption latency: from the request reaching every rank to the ranks agreeing to stop (docs/restarts.md).

Runs the trainer (``-m worker.trainer`` under torchrun, as the agent starts it) on the
scikit-learn digits, resnet18, 2 processes by default, and while epoch 2 trains writes
``preempt-request`` into the run directory, as the agent does on a drain or SIGTERM
(both ranks of a node read the same file, so the request reaches every rank at once).
The ranks look for it at every step boundary and agree with one all-reduce that
travels while the next batch is fetched; rank 0's log says when they agreed
("preemption requested: every rank stops after step N").

Latency = that log line's time - the moment the file was written. It is compared with
the step time (batch x processes / the images/sec of epoch 1): the promise is at most
one step (plus fetching a batch) after the request arrives. The request lands at a
random point of a step, so the latency of one round lies between 0 and that bound.

    python bench/bench_preemption.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from torchyard.sample_data import write_digits
from worker.agent.node import usable_cpus
from worker.trainer.control import PREEMPT_REQUEST_FILE, PREEMPTED_FILE

REPO = Path(__file__).resolve().parents[1]
AGREED = "preemption requested: every rank stops after step"


def _job(run_dir: Path, data: Path, args: argparse.Namespace) -> Path:
    run_dir.mkdir(parents=True)
    job = {
        "job_id": "bench-preemption",
        "attempt_id": run_dir.name,
        "model": {"architecture": args.arch, "pretrained": False, "memory_efficient": False},
        "init_from_dir": None,
        "parameters": {
            "epochs": 3,
            "batch_size": args.batch_size,
            "warmup_epochs": 0,
            "learning_rate": 0.01,
            "random_seed": 1,
            "patience": 3,
            "print_frequency": 50,
            "image_size": args.image_size,
            "augmentation": "light",
        },
        "train_dir": str(data / "train"),
        "val_dir": str(data / "val"),
        "classes": [str(i) for i in range(10)],
        "datasets": None,
        "output_dir": str(run_dir),
        "loader_workers": None,
    }
    path = run_dir / "job.json"
    path.write_text(json.dumps(job))
    return path


def _events(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def one_round(run_dir: Path, data: Path, args: argparse.Namespace) -> tuple[float, float, int]:
    """(latency s, step s, step stopped after) of one preempted run."""
    job = _job(run_dir, data, args)
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
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += [str(args.nproc), "-m", "worker.trainer", "--config", str(job)]
    log_path = run_dir / "trainer.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rate = None
            while rate is None:  # epoch 1 ended: its images/sec gives the step time
                if process.poll() is not None:
                    raise SystemExit(f"the run ended before epoch 2:\n{log_path.read_text()[-3000:]}")
                points = [
                    e for e in _events(run_dir) if e.get("name") == "epoch.seconds" and e.get("epoch") == 1
                ]
                if points:
                    rates = [
                        float(str(e["value"]))
                        for e in _events(run_dir)
                        if e.get("name") == "train.images_per_sec" and e.get("epoch") == 1
                    ]
                    rate = rates[-1]
                time.sleep(0.05)
            step_s = args.batch_size * args.nproc / rate
            # Somewhere in the first third of epoch 2, at a random point of a step.
            time.sleep(random.uniform(2, 6) * step_s)
            requested = time.time()
            (run_dir / PREEMPT_REQUEST_FILE).write_text("")
            code = process.wait(timeout=600)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if code != 0 or not (run_dir / PREEMPTED_FILE).is_file():
        raise SystemExit(f"the run was not preempted ({code}):\n{text[-3000:]}")
    line = next(line for line in text.splitlines() if "[rank 0]" in line and AGREED in line)
    stamp = " ".join(line.split("] ", 1)[1].split(" ", 2)[:2])
    agreed = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    step = int(line.split(AGREED, 1)[1].split()[0])
    return agreed - requested, step_s, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-preemption-") as tmp:
        root = Path(tmp)
        write_digits(root / "digits", size=args.image_size)
        print(
            f"{args.arch} at {args.image_size} px, batch {args.batch_size}, {args.nproc} processes, "
            f"load average {os.getloadavg()[0]:.1f} at the start",
            flush=True,
        )
        rows = []
        for i in range(1, args.rounds + 1):
            latency, step_s, step = one_round(root / f"run-{i}", root / "digits", args)
            rows.append((latency, step_s))
            print(
                f"round {i}: stopped after step {step} of epoch 2, latency {latency:.3f} s, "
                f"step {step_s:.3f} s ({latency / step_s:.2f} steps)",
                flush=True,
            )
    latencies = [r[0] for r in rows]
    ratios = [r[0] / r[1] for r in rows]
    print(
        f"median latency {statistics.median(latencies):.3f} s, max {max(latencies):.3f} s; "
        f"in steps: median {statistics.median(ratios):.2f}, max {max(ratios):.2f} "
        f"(load average {os.getloadavg()[0]:.1f} at the end)"
    )


if __name__ == "__main__":
    main()
