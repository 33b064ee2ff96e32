"""What each rank's system metrics (worker/trainer/system_metrics.py) cost a training step.

Three figures, each in this process:

* the check the training loop makes after every step (two more clock reads and
  :meth:`SystemSampler.step_done` with the interval not up), in nanoseconds;
* one sample (``/proc`` of the rank and its DataLoader workers, ``--workers`` child processes
  here, its memory, and the line written), in microseconds;
* a real training step for scale: resnet18 on 16 images of 32 px on one CPU thread, the
  smallest step the test suite trains.

The cost per step is the check plus one sample spread over the steps of an interval
(``--interval``, 5 s by default): ``check + sample × step / interval``.

Usage (from the repository root)::

    python -m bench.bench_system_metrics
    python -m bench.bench_system_metrics --workers 8 --interval 5
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from worker.trainer.system_metrics import NO_SAMPLER, SystemSampler


def per_step_check_ns(sampler: SystemSampler | object, steps: int) -> float:
    """The loop's own additions per step: its clock reads and the sampler's check."""
    step_done = sampler.step_done  # type: ignore[attr-defined]
    clock = time.perf_counter
    begin = clock()
    for step in range(steps):
        asked = clock()
        fetched = clock()
        step_done(1, step, started=asked, fetched=fetched, now=clock())
    return (clock() - begin) / steps * 1e9


def sample_us(sampler: SystemSampler, samples: int) -> float:
    begin = time.perf_counter()
    for i in range(samples):
        sampler.step_done(1, i, started=0.0, fetched=0.0, now=0.0)  # one step in the window
        sampler.sample(1, i, time.perf_counter())
    return (time.perf_counter() - begin) / samples * 1e6


def training_step_ms(steps: int) -> float:
    import torch
    import torchvision

    torch.set_num_threads(1)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - begin) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="child processes standing for DataLoader workers"
    )
    parser.add_argument("--interval", type=float, default=5.0, help="the sampling interval (s)")
    parser.add_argument("--checks", type=int, default=200_000)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    children = [
        subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        for _ in range(args.workers)
    ]
    try:
        with tempfile.TemporaryDirectory() as folder:
            sampler = SystemSampler(Path(folder) / "sys-rank-0.jsonl", 0, args.interval)
            sampler.due = float("inf")  # the check alone: never due
            off = per_step_check_ns(NO_SAMPLER, args.checks)
            on = per_step_check_ns(sampler, args.checks)
            sample = sample_us(sampler, args.samples)
            sampler.close()
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
            child.wait()
    step = training_step_ms(args.steps)
    per_step_us = on / 1e3 + sample * (step / 1e3) / args.interval
    print(f"machine: {platform.machine()}, python {platform.python_version()}")
    print(f"per-step check, metrics off:  {off:8.0f} ns")
    print(f"per-step check, metrics on:   {on:8.0f} ns")
    print(f"one sample ({args.workers} workers):     {sample:8.1f} us")
    print(f"resnet18 step, 16 x 32 px:    {step:8.1f} ms")
    print(
        f"cost: {per_step_us:.2f} us per step = {per_step_us / (step * 1e3):.4%} of that step "
        f"(sampling every {args.interval:g} s)"
    )


if __name__ == "__main__":
    main()
