"""The trainer's input pipeline with and without the decoded-image cache (bench/RESULTS.md).

Writes photo-sized JPEGs (``torchyard.sample_data.write_photos``: crops of
scikit-learn's two bundled photos, 400-500 px on the long side), then, for each image
size, iterates the training loader that ``worker.trainer.data.build_loaders`` builds
for a one-rank CPU job (no model: the input pipeline alone), ``--epochs`` epochs:

* ``today``: ``TORCHYARD_IMAGE_CACHE=0``, every epoch decodes each JPEG and crops the
  original photo;
* ``cache``: the decoded-image cache (``worker.trainer.image_cache``) in a temporary
  folder. Epoch 1 decodes on the fly while the writer process fills the cache beside
  it; the bench then waits for the cache to be complete (the wait is shown) and the
  later epochs read it. The loader workers crop each image (``worker.trainer.data.crop_each``,
  as on a CPU node; a GPU node crops the same boxes a batch at a time on the GPU).

The figure is images/s of the epochs after the first (their mean); epoch 1 is shown
beside it. Loader workers: the trainer's default for the machine (``--workers``).

Usage::

    python bench/bench_input.py                        # 64, 96 and 224 px, 1000 photos
    python bench/bench_input.py --sizes 224 --per-class 200 --epochs 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from torchyard.modeldir import image_directory_samples
from torchyard.sample_data import write_photos
from worker.trainer import image_cache
from worker.trainer.config import JobConfig
from worker.trainer.data import build_loaders, default_loader_workers
from worker.trainer.distributed import DistEnv

ENV = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_name="bench")
CPU = torch.device("cpu")


def job_config(root: Path, classes: list[str], size: int, args: argparse.Namespace) -> JobConfig:
    return JobConfig.model_validate(
        {
            "job_id": "bench-input",
            "model": {"architecture": "resnet18"},
            "parameters": {
                "image_size": size,
                "batch_size": args.batch_size,
                "augmentation": "standard",
                "random_seed": 1,
            },
            "train_dir": str(root / "train"),
            "val_dir": str(root / "val"),
            "classes": classes,
            "datasets": {
                "train": {"id": "photos", "sha256": f"{size:064d}"},
                "validation": {"id": "photos-val"},
            },
            "output_dir": str(root / "out"),
            "loader_workers": args.workers,
        }
    )


def run_epochs(
    job: JobConfig, epochs: int, entry: image_cache.CacheEntry | None
) -> tuple[list[float], float]:
    """images/s of each epoch, and the wait for the cache after epoch 1."""
    loaders = build_loaders(job, ENV, CPU)
    rates: list[float] = []
    waited = 0.0
    for epoch in range(epochs):
        loaders.train_sampler.set_epoch(epoch)
        started = time.perf_counter()
        images = 0
        for batch in loaders.train:
            # A GPU node's loader leaves the crops to the GPU's step (none here: the loader crops).
            pixels = loaders.on_device(batch)[0] if loaders.on_device is not None else batch[0]
            images += pixels.shape[0]
        rates.append(images / (time.perf_counter() - started))
        if epoch == 0 and entry is not None:
            wait_from = time.perf_counter()
            while not entry.ready():
                time.sleep(0.05)
            waited = time.perf_counter() - wait_from
    del loaders
    return rates, waited


def measure(
    size: int,
    root: Path,
    classes: list[str],
    samples: list[tuple[str, int]],
    cache_dir: Path,
    args: argparse.Namespace,
) -> dict[str, object]:
    """One image size: today's pipeline, then the cache's; printed and returned."""
    job = job_config(root, classes, size, args)
    row: dict[str, object] = {"size": size}
    later: dict[str, float] = {}
    for mode in ("today", "cache"):
        entry = None
        if mode == "today":
            os.environ[image_cache.ENV_SWITCH] = "0"
            os.environ.pop(image_cache.ENV_DIR, None)
        else:
            os.environ[image_cache.ENV_SWITCH] = "1"
            os.environ[image_cache.ENV_DIR] = str(cache_dir)
            sha = job.datasets.train.sha256 if job.datasets else None
            entry = image_cache.cache_entry(
                cache_dir, job.train_dir, sha, samples, image_cache.cache_size(size)
            )
        rates, waited = run_epochs(job, args.epochs, entry)
        later[mode] = sum(rates[1:]) / max(1, len(rates) - 1)
        row[mode] = {"epoch1": rates[0], "later": later[mode], "cache_wait_s": waited}
        print(f"{size:>5} {mode:>8} {rates[0]:>14.0f} {later[mode]:>16.0f} {waited:>13.1f}", flush=True)
    print(f"{size:>5} speed-up of epochs 2+: x{later['cache'] / later['today']:.1f}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,96,224", help="image sizes, comma-separated")
    parser.add_argument("--per-class", type=int, default=100, help="training photos per class (10 classes)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=default_loader_workers(CPU, 1))
    parser.add_argument("--data", help="a folder for the photos (kept; reused when present)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    root = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="photos-"))
    if not (root / "train").is_dir():
        started = time.perf_counter()
        write_photos(
            root, classes=10, train_per_class=args.per_class, val_per_class=2, workers=os.cpu_count() or 1
        )
        print(
            f"wrote {10 * args.per_class} training JPEGs in {time.perf_counter() - started:.1f} s", flush=True
        )
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    samples = image_directory_samples(root / "train", classes)
    cache_dir = Path(tempfile.mkdtemp(prefix="image-cache-"))
    print(
        f"{len(samples)} JPEG photos, batch {args.batch_size}, {args.workers} loader worker(s), "
        f"{torch.get_num_threads()} torch thread(s), {os.cpu_count()} CPUs, CUDA: {torch.cuda.is_available()}"
    )
    print(f"{'size':>5} {'pipeline':>8} {'epoch 1 img/s':>14} {'epochs 2+ img/s':>16} {'cache wait s':>13}")
    try:
        results = [
            measure(size, root, classes, samples, cache_dir, args) for size in map(int, args.sizes.split(","))
        ]
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        if not args.data:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
