"""GPU throughput of ResNet-50 at 224 px, bf16, channels_last: synthetic data, then the real pipeline.

Needs a CUDA GPU. Three parts, each one command (all three by default):

* ``synthetic``: the training step alone on a random batch kept on the GPU; the batch
  per GPU is chosen by a sweep (``--batch-sizes``). Each configuration reports
  images/s (mean over ``--steps`` timed steps after ``--warmup``), peak GPU memory and
  GPU utilisation (NVML, sampled every 100 ms). Variants: DistributedDataParallel of
  one process (as the trainer always runs), fused SGD, and ``torch.compile``
  (``--compile``).
* ``decode``: the cost of the image pipeline alone, on a generated JPEG set of
  photo-sized images (``torchyard.sample_data.write_photos``): the trainer's own
  loader (PIL decode + RandomResizedCrop + flip in DataLoader workers) against GPU
  decoding with ``torchvision.io.decode_jpeg(device="cuda")`` and crop/resize on the GPU.
* ``pipeline``: the training step fed by the trainer's own loader
  (``worker.trainer.data``) and ``BatchPreparer`` on those JPEGs, against the
  synthetic figure at the same batch size.

Usage::

    python bench/bench_gpu.py                                # everything
    python bench/bench_gpu.py synthetic --batch-sizes 128,256,384 --compile
    python bench/bench_gpu.py pipeline --batch-size 256 --workers 15
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_common import (
    GpuSampler,
    describe_device,
    resnet50,
    sgd,
    table,
    timed_window,
    train_step_fn,
)
from torch.nn.parallel import DistributedDataParallel

IMAGE_SIZE = 224


def _ensure_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )


def measure_synthetic(
    batch: int, *, steps: int, warmup: int, ddp: bool, fused: bool, compile_mode: str | None
) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = resnet50()
    optimizer = sgd(model, fused=fused)
    wrapped: torch.nn.Module = model
    if ddp:
        _ensure_group()
        wrapped = DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=True)
    if compile_mode:
        wrapped = torch.compile(wrapped, mode=None if compile_mode == "default" else compile_mode)  # type: ignore[assignment]
    step = train_step_fn(wrapped, optimizer)
    images = torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, device="cuda").contiguous(
        memory_format=torch.channels_last
    )
    targets = torch.randint(0, 1000, (batch,), device="cuda")
    compile_started = time.perf_counter()
    for _ in range(warmup):
        step(images, targets)
    torch.cuda.synchronize()
    warm_seconds = time.perf_counter() - compile_started
    with GpuSampler() as gpu, timed_window() as window:
        for _ in range(steps):
            step(images, targets)
    rate = batch * steps / window["seconds"]
    result = {
        "batch": batch,
        "images_per_sec": rate,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu_util": gpu.mean,
        "warmup_s": warm_seconds,
    }
    del model, optimizer, wrapped, step, images
    torch.cuda.empty_cache()
    return result


def cmd_synthetic(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[list[str]] = []
    best: dict[str, Any] | None = None
    variants: list[tuple[str, bool, bool, str | None]] = [
        ("eager, DDP(1), foreach SGD", True, False, None),
        ("eager, DDP(1), fused SGD", True, True, None),
    ]
    if args.no_ddp:
        variants.append(("eager, no DDP, fused SGD", False, True, None))
    for batch in args.batch_sizes:
        for label, ddp, fused, mode in variants:
            try:
                r = measure_synthetic(
                    batch, steps=args.steps, warmup=args.warmup, ddp=ddp, fused=fused, compile_mode=mode
                )
            except torch.OutOfMemoryError:
                rows.append([label, str(batch), "out of memory", "", ""])
                torch.cuda.empty_cache()
                continue
            rows.append(_row(label, r))
            print(f"  {label}, batch {batch}: {r['images_per_sec']:.0f} images/s", flush=True)
            if best is None or r["images_per_sec"] > best["images_per_sec"]:
                best = {**r, "variant": label}
    assert best is not None
    for mode in args.compile:
        label = f"torch.compile({mode}), DDP(1), fused SGD"
        r = measure_synthetic(
            best["batch"],
            steps=args.steps,
            warmup=args.compile_warmup,
            ddp=True,
            fused=True,
            compile_mode=mode,
        )
        rows.append(_row(label, r))
        print(
            f"  {label}, batch {best['batch']}: {r['images_per_sec']:.0f} images/s (warm-up {r['warmup_s']:.0f}s)",
            flush=True,
        )
    print("\nsynthetic data, ResNet-50, 224 px, bf16 autocast, channels_last:")
    print(table(rows, ["variant", "batch/GPU", "images/s", "peak GPU memory", "GPU util"]))
    print(f"best eager: {best['variant']} at batch {best['batch']}: {best['images_per_sec']:.0f} images/s")
    return best


def _row(label: str, r: dict[str, Any]) -> list[str]:
    util = "n/a" if r["gpu_util"] is None else f"{r['gpu_util']:.0f} %"
    return [label, str(r["batch"]), f"{r['images_per_sec']:.0f}", f"{r['peak_mem_gib']:.1f} GiB", util]


# --------------------------------------------------------------------------- real images


def photo_set(args: argparse.Namespace) -> Path:
    from torchyard.sample_data import write_photos

    root = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="photos-"))
    if not (root / "train").is_dir():
        started = time.perf_counter()
        write_photos(
            root,
            classes=10,
            train_per_class=args.per_class,
            val_per_class=10,
            workers=os.cpu_count() or 1,
        )
        print(
            f"wrote {10 * args.per_class} training JPEGs in {time.perf_counter() - started:.1f}s", flush=True
        )
    return root


def trainer_loader(root: Path, batch: int, workers: int, prefetch: int) -> torch.utils.data.DataLoader[Any]:
    """The trainer's training loader on ``root/train`` (same dataset class, transform, options)."""
    from torchyard.modeldir import image_directory_samples
    from worker.trainer.data import ImageDataset, train_transform

    classes = sorted(p.name for p in (root / "train").iterdir())
    samples = image_directory_samples(str(root / "train"), classes)
    dataset = ImageDataset(samples, train_transform(IMAGE_SIZE, "standard"))
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=True,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch if workers > 0 else None,
    )


class EncodedFiles(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """File bytes as uint8 tensors (the GPU does the decoding)."""

    def __init__(self, root: Path) -> None:
        from torchyard.modeldir import image_directory_samples

        classes = sorted(p.name for p in (root / "train").iterdir())
        self.samples = image_directory_samples(str(root / "train"), classes)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.io import read_file

        path, target = self.samples[index]
        return read_file(path), target


def _encoded_collate(batch: list[tuple[torch.Tensor, int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    return [b[0] for b in batch], torch.tensor([b[1] for b in batch])


def gpu_random_resized_crop(
    images: list[torch.Tensor], size: int, generator: torch.Generator
) -> torch.Tensor:
    """RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) + horizontal flip of decoded CHW uint8
    GPU images, as one uint8 batch."""
    from torchvision.transforms.v2 import RandomResizedCrop

    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=images[0].device)
    flips = torch.rand(len(images), generator=generator) < 0.5
    for i, image in enumerate(images):
        top, left, h, w = RandomResizedCrop.get_params(image, scale=[0.08, 1.0], ratio=[3 / 4, 4 / 3])  # type: ignore[arg-type]
        crop = image[:, top : top + h, left : left + w].unsqueeze(0).float()
        resized = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        if flips[i]:
            resized = resized.flip(-1)
        out[i] = resized[0].round_().clamp_(0, 255).to(torch.uint8)
    return out


def gpu_decode_batches(root: Path, batch: int, workers: int) -> Any:
    from torchvision.io import ImageReadMode, decode_jpeg

    loader = torch.utils.data.DataLoader(
        EncodedFiles(root),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        collate_fn=_encoded_collate,
    )
    generator = torch.Generator().manual_seed(0)
    while True:
        for data, targets in loader:
            decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
            images = gpu_random_resized_crop(list(decoded), IMAGE_SIZE, generator)
            yield images, targets.cuda(non_blocking=True)


def cpu_batches(root: Path, batch: int, workers: int, prefetch: int) -> Any:
    loader = trainer_loader(root, batch, workers, prefetch)
    while True:
        for images, targets in loader:
            yield images.cuda(non_blocking=True), targets.cuda(non_blocking=True)


def rate_of(
    batches: Any, batch: int, steps: int, warmup: int, work: Any = None
) -> tuple[float, float | None]:
    for _ in range(warmup):
        images, targets = next(batches)
        if work is not None:
            work(images, targets)
    with GpuSampler() as gpu, timed_window() as window:
        for _ in range(steps):
            images, targets = next(batches)
            if work is not None:
                work(images, targets)
    return batch * steps / window["seconds"], gpu.mean


def cmd_decode(args: argparse.Namespace) -> None:
    root = photo_set(args)
    rows = []
    for workers in args.worker_counts:
        rate, _ = rate_of(
            cpu_batches(root, args.batch_size, workers, args.prefetch), args.batch_size, args.steps, 3
        )
        rows.append([f"PIL in {workers} loader workers (the trainer's loader)", f"{rate:.0f}", "n/a"])
        print(f"  cpu decode, {workers} workers: {rate:.0f} images/s", flush=True)
    for workers in (4, 8):
        rate, util = rate_of(
            gpu_decode_batches(root, args.batch_size, workers), args.batch_size, args.steps, 3
        )
        rows.append(
            [
                f"decode_jpeg(device='cuda') + GPU crop, {workers} file readers",
                f"{rate:.0f}",
                f"{util or 0:.0f} %",
            ]
        )
        print(f"  gpu decode, {workers} readers: {rate:.0f} images/s", flush=True)
    print(
        f"\nimage pipeline alone (JPEG decode + random resized crop + flip to {IMAGE_SIZE} px, batch {args.batch_size}):"
    )
    print(table(rows, ["pipeline", "images/s", "GPU util"]))


def cmd_pipeline(args: argparse.Namespace, synthetic: float | None = None) -> None:
    from torchyard import modeldir
    from worker.trainer.engine import BatchPreparer

    root = photo_set(args)
    rows = []
    if synthetic is None:
        synthetic = measure_synthetic(
            args.batch_size, steps=args.steps, warmup=args.warmup, ddp=True, fused=True, compile_mode=None
        )["images_per_sec"]
    for name, make in (
        (
            "trainer loader (PIL in workers)",
            lambda: cpu_batches(root, args.batch_size, args.workers, args.prefetch),
        ),
        ("GPU decode", lambda: gpu_decode_batches(root, args.batch_size, 8)),
    ):
        if name == "GPU decode" and not args.gpu_decode:
            continue
        _ensure_group()
        model = resnet50(num_classes=10)
        optimizer = sgd(model, fused=True)
        ddp = DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=True)
        step = train_step_fn(ddp, optimizer)
        prepare = BatchPreparer(torch.device("cuda", 0), modeldir.IMAGENET_MEAN, modeldir.IMAGENET_STD)

        def work(
            images: torch.Tensor, targets: torch.Tensor, step: Any = step, prepare: Any = prepare
        ) -> None:
            batch, labels = prepare(images, targets)
            step(batch, labels)

        rate, util = rate_of(make(), args.batch_size, args.steps, args.warmup, work)
        rows.append([name, f"{rate:.0f}", f"{util or 0:.0f} %", f"{rate / synthetic:.3f}"])
        print(
            f"  training fed by {name}: {rate:.0f} images/s ({rate / synthetic:.1%} of synthetic)", flush=True
        )
        del model, optimizer, ddp, step
        torch.cuda.empty_cache()
    print(
        f"\nResNet-50 training on JPEG photos, batch {args.batch_size}, {args.workers} loader workers "
        f"(synthetic at the same batch: {synthetic:.0f} images/s):"
    )
    print(table(rows, ["input", "images/s", "GPU util", "/ synthetic"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", default="all", choices=["all", "synthetic", "decode", "pipeline"])
    parser.add_argument("--batch-sizes", default="128,192,256,384")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="decode/pipeline batch (default: best of the sweep, else 256)",
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--compile", default="", help="comma list of torch.compile modes to try, e.g. default,max-autotune"
    )
    parser.add_argument("--compile-warmup", type=int, default=20)
    parser.add_argument("--no-ddp", action="store_true", help="also measure without the DDP wrapper")
    parser.add_argument("--data", default=None, help="JPEG ImageDirectory root (written when missing)")
    parser.add_argument("--per-class", type=int, default=400)
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: the trainer's)")
    parser.add_argument("--worker-counts", default="", help="decode: loader worker counts to try")
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument(
        "--gpu-decode", action="store_true", help="pipeline: also train from GPU-decoded images"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "bench_gpu needs a CUDA GPU\n")
    torch.backends.cudnn.benchmark = True
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.compile = [m for m in args.compile.split(",") if m]
    if args.workers is None:
        from worker.trainer.data import default_loader_workers

        args.workers = default_loader_workers(torch.device("cuda", 0), 1)
    args.worker_counts = [int(w) for w in args.worker_counts.split(",") if w] or [args.workers]
    print(describe_device())
    print(
        f"CPUs usable: {len(os.sched_getaffinity(0))}; loader workers (trainer default): {args.workers}",
        flush=True,
    )
    synthetic = None
    if args.part in ("all", "synthetic"):
        best = cmd_synthetic(args)
        if args.batch_size is None:
            args.batch_size = best["batch"]
        synthetic = best["images_per_sec"] if best["batch"] == args.batch_size else None
    if args.batch_size is None:
        args.batch_size = 256
    if args.part in ("all", "decode"):
        cmd_decode(args)
    if args.part in ("all", "pipeline"):
        cmd_pipeline(args, synthetic)


if __name__ == "__main__":
    main()
