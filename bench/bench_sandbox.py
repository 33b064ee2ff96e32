"""What the sandbox (worker.agent.sandbox) costs a run at start: the same command started
directly and in a run's bubblewrap sandbox, alternated, ``--runs`` times each.

Two commands: ``true`` (the sandbox's own cost: namespaces, mounts, PID 1) and
``python -c pass`` with the worker's interpreter (what a rank or a script process pays
before its first line). Prints the median and 90th percentile of each, and the median
difference. Run as root, it also times the sandbox keeping root (``TORCHYARD_SANDBOX_USER=root``)
against the default (``setpriv`` to ``nobody``), and a run without network
(``environment.network: none``: its own network namespace).

Usage::

    python bench/bench_sandbox.py [--runs 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.agent import sandbox  # noqa: E402


def _time(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - started) * 1000.0


def _summary(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"median {statistics.median(values):7.1f} ms   p90 {p90:7.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    if sandbox.mode({}) != sandbox.BWRAP:
        sys.exit(f"no working bubblewrap here: {sandbox.unavailable_reason()}")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "work" / "runs" / "job-a1-node"
        run_dir.mkdir(parents=True)
        box = sandbox.Sandbox(writable=run_dir, hidden=[Path(tmp) / "work"])
        boxes = {"sandboxed": box}
        if box.user is not None:
            boxes = {
                "sandboxed, root": dataclasses.replace(box, user=None),
                "sandboxed, nobody": box,
                "+ no network": dataclasses.replace(box, network=False),
            }
        box.give_writable()
        for name, command in (("true", ["true"]), ("python -c pass", [sys.executable, "-c", "pass"])):
            plain: list[float] = []
            boxed: dict[str, list[float]] = {label: [] for label in boxes}
            for _ in range(args.runs):
                plain.append(_time(command))
                for label, each in boxes.items():
                    boxed[label].append(_time(each.command(command, run_dir)))
            print(f"{name:16s} {'direct':18s} {_summary(plain)}")
            for label, values in boxed.items():
                extra = statistics.median(values) - statistics.median(plain)
                print(f"{name:16s} {label:18s} {_summary(values)}   (+{extra:.1f} ms a start)")


if __name__ == "__main__":
    main()
