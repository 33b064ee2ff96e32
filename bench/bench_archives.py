"""Packing a model directory and an outputs folder: CPU and size, gzip at one level against the
writer that stores what does not compress (torchyard/contract/deflate.py).

The new way is the agent's own ``pack_outputs`` (which also hashes the archive). The model
directory is a ResNet (``--architecture``, random weights as a fresh job's are) in
safetensors, with its config and metrics; the outputs folder holds that model directory, a
JSON-lines log and a CSV of metrics, as a script job's outputs would. Each way of packing runs
``--repeat`` times; the CPU time is the median.

Usage (from the repository root)::

    python -m bench.bench_archives
    python -m bench.bench_archives --architecture resnet50
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import statistics
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from worker.agent.script_outputs import pack_outputs


def _model_dir(root: Path, architecture: str) -> Path:
    import torch
    import torchvision
    from safetensors.torch import save_file

    folder = root / "model"
    folder.mkdir()
    model = getattr(torchvision.models, architecture)(num_classes=10)
    with torch.no_grad():
        for p in model.parameters():  # a little away from the initial values, as after training
            p.add_(torch.randn_like(p) * 1e-3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": architecture, "num_classes": 10}))
    (folder / "metrics.json").write_text(json.dumps({"val.top1": 0.9}))
    return folder


def _outputs(root: Path, model: Path) -> Path:
    folder = root / "outputs"
    folder.mkdir()
    (folder / "model").mkdir()
    for f in model.iterdir():
        (folder / "model" / f.name).write_bytes(f.read_bytes())
    rng = random.Random(0)
    with open(folder / "train.jsonl", "w") as fh:
        for step in range(200_000):
            fh.write(json.dumps({"step": step, "loss": rng.random(), "lr": 0.1}) + "\n")
    with open(folder / "metrics.csv", "w") as fh:
        fh.write("epoch,top1,loss\n")
        for epoch in range(20_000):
            fh.write(f"{epoch},{rng.random():.4f},{rng.random():.4f}\n")
    return folder


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def pack_one_level(folder: Path, dest: Path, level: int) -> None:
    with (
        open(dest, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=level) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for path in _files(folder):
            tar.add(path, arcname=str(path.relative_to(folder)))


def pack_chosen(folder: Path, dest: Path) -> None:
    """What the agent does with a script job's outputs (its sha256 included)."""
    pack_outputs(folder, dest)


def _measure(pack: Callable[[Path, Path], None], folder: Path, dest: Path, repeat: int) -> tuple[float, int]:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        pack(folder, dest)
        times.append(time.process_time() - start)
    return statistics.median(times), dest.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="resnet18")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _model_dir(root, args.architecture)
        outputs = _outputs(root, model)
        dest = root / "out.tar.gz"
        print("| folder | unpacked | packing | CPU (median) | archive | of unpacked |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, folder in ((f"model directory ({args.architecture})", model), ("script outputs", outputs)):
            unpacked = sum(p.stat().st_size for p in _files(folder))
            ways: list[tuple[str, Callable[[Path, Path], None]]] = [
                ("gzip level 1", lambda f, d: pack_one_level(f, d, 1)),
                ("gzip level 9", lambda f, d: pack_one_level(f, d, 9)),
                ("stored where it does not compress, else level 6", pack_chosen),
            ]
            for name, pack in ways:
                cpu, size = _measure(pack, folder, dest, args.repeat)
                print(
                    f"| {label} | {unpacked / 1e6:.1f} MB | {name} | {cpu:.2f} s "
                    f"| {size / 1e6:.1f} MB | {size / unpacked:.3f} |"
                )


if __name__ == "__main__":
    main()
