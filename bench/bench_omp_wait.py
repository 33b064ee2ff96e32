"""OpenMP threads spinning or sleeping while they wait: a two-thread resnet18 training step,
alone and beside busy processes (why the test suite runs its ranks with
``OMP_WAIT_POLICY=PASSIVE``, tests/conftest.py).

Each case runs in a fresh process (the policy is read when OpenMP starts): 40 steps of
resnet18 on a batch of 16 images of 32 px, on two threads; its wall time and the CPU time
it used. ``--busy N`` busy-loop processes run beside the measured ones.

Usage (from the repository root)::

    python -m bench.bench_omp_wait
    python -m bench.bench_omp_wait --busy 2 --steps 40
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import subprocess
import sys

_STEPS = """
import sys, time, torch, torchvision
torch.set_num_threads(2)
model = torchvision.models.resnet18(num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
for _ in range(3):
    step()
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(int(sys.argv[1])):
    step()
print(f"{time.perf_counter() - wall:.2f} {time.process_time() - cpu:.2f}")
"""


def _spin() -> None:
    while True:
        pass


def _run(policy: str | None, steps: int) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, str(steps)], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the loaded runs")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print("| beside | OMP_WAIT_POLICY | wall | CPU |")
    print("| --- | --- | --- | --- |")
    for busy in (0, args.busy):
        spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            for _ in range(args.repeat):
                for policy in (None, "PASSIVE"):
                    wall, cpu = _run(policy, args.steps)
                    print(
                        f"| {busy} busy processes | {policy or 'unset (active)'} | {wall:.2f} s | {cpu:.2f} s |"
                    )
        finally:
            for p in spinners:
                p.terminate()
                p.join()


if __name__ == "__main__":
    main()
