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
* ``profile``: where GPU decoding's time goes, stage by stage, without training.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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


def trainer_loader(root: Path, batch: int, workers: int, prefetch: int, gpu: bool, share: float = 0.0) -> Any:
    """The trainer's training loader on ``root/train`` (same dataset classes, transform, options)."""
    from torchyard.modeldir import image_directory_samples
    from worker.trainer.data import ImageDataset, train_transform
    from worker.trainer.gpu_decode import EncodedTrainSet, encoded_collate

    classes = sorted(p.name for p in (root / "train").iterdir())
    samples = image_directory_samples(str(root / "train"), classes)
    transform = train_transform(IMAGE_SIZE, "standard")
    dataset: Any = EncodedTrainSet(samples, transform, share) if gpu else ImageDataset(samples, transform)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=True,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch if workers > 0 else None,
        collate_fn=encoded_collate if gpu else None,
    )


def previous_decoder(device: torch.device, image_size: int) -> Any:
    """The trainer's GPU decoder with the crop boxes drawn as before, image by image
    (torchvision's ``RandomResizedCrop.get_params``: several tiny tensor operations each):
    this benchmark's reference for drawing a batch's boxes at once."""
    from torchvision.transforms import v2 as T

    from worker.trainer.gpu_decode import GpuDecoder

    class PerImageBoxes(GpuDecoder):
        def _boxes(self, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            boxes = []
            for height, width in sizes.tolist():
                image = torch.empty((3, height, width), dtype=torch.uint8)  # get_params reads the shape
                top, left, h, w = T.RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
                boxes.append([left, top, w, h])
            flips = torch.tensor([torch.rand(1).item() < 0.5 for _ in boxes])
            return torch.tensor(boxes, dtype=torch.float64), flips

    return PerImageBoxes(device, image_size, "standard")


def batches(
    root: Path,
    batch: int,
    workers: int,
    prefetch: int,
    gpu: bool,
    share: float = 0.0,
    geometry: str = "batch",
) -> Iterator[Any]:
    """Normalized device batches, endlessly, exactly as the trainer prepares them
    (``geometry="per-image"``: with the previous crop boxes, drawn image by image)."""
    from torchyard import modeldir
    from worker.trainer.gpu_decode import GpuDecoder
    from worker.trainer.loop import BatchPreparer, DecodeThenPrepare, device_batches

    device = torch.device("cuda", 0)
    loader = trainer_loader(root, batch, workers, prefetch, gpu, share)
    prepare: Any = BatchPreparer(device, modeldir.IMAGENET_MEAN, modeldir.IMAGENET_STD)
    if gpu:
        decoder: Any = (
            previous_decoder(device, IMAGE_SIZE)
            if geometry == "per-image"
            else GpuDecoder(device, IMAGE_SIZE, "standard")
        )
        prepare = DecodeThenPrepare(decoder, prepare)
    while True:
        yield from device_batches(loader, prepare, device)


def rate_of(
    source: Iterator[Any], batch: int, steps: int, warmup: int, work: Any = None
) -> tuple[float, float | None]:
    for _ in range(warmup):
        images, targets = next(source)
        if work is not None:
            work(images, targets)
    with GpuSampler() as gpu, timed_window() as window:
        for _ in range(steps):
            images, targets = next(source)
            if work is not None:
                work(images, targets)
    return batch * steps / window["seconds"], gpu.mean


def cmd_decode(args: argparse.Namespace) -> None:
    root = photo_set(args)
    rows = []
    for gpu, counts in ((False, args.worker_counts), (True, args.gpu_worker_counts)):
        for workers in counts:
            source = batches(root, args.batch_size, workers, args.prefetch, gpu)
            rate, util = rate_of(source, args.batch_size, args.steps, 3)
            what = "nvJPEG decode + GPU crop/flip" if gpu else "PIL decode + crop/flip (CPU)"
            rows.append([what, str(workers), f"{rate:.0f}", "n/a" if util is None else f"{util:.0f} %"])
            print(f"  {what}, {workers} workers: {rate:.0f} images/s", flush=True)
    print(
        f"\nimage pipeline alone, the trainer's classes (JPEG -> random resized crop + flip at "
        f"{IMAGE_SIZE} px, normalized on the GPU), batch {args.batch_size}:"
    )
    print(table(rows, ["decoding", "loader workers", "images/s", "GPU util"]))


# (label, decoded on the GPU, GPU geometry, forward compiled) of the pipeline part's variants.
PIPELINE_VARIANTS = {
    "pil": ("PIL in the loader workers", False, "", False),
    "per-image": ("nvJPEG, crop boxes drawn image by image (previous)", True, "per-image", False),
    "batch": ("nvJPEG, crop boxes drawn per batch", True, "batch", False),
    "batch-compiled": ("nvJPEG, crop boxes drawn per batch; compiled forward", True, "batch", True),
}


def cmd_pipeline(args: argparse.Namespace) -> None:
    from worker.trainer.compiling import CompiledForward

    root = photo_set(args)
    synthetic: dict[bool, float] = {}
    for compiled in sorted({PIPELINE_VARIANTS[v][3] for v in args.variants}):
        synthetic[compiled] = measure_synthetic(
            args.batch_size,
            steps=args.steps,
            warmup=args.compile_warmup if compiled else args.warmup,
            ddp=True,
            fused=True,
            compile_mode="default" if compiled else None,
        )["images_per_sec"]
        print(
            f"  synthetic, {'compiled' if compiled else 'eager'}: {synthetic[compiled]:.0f} images/s",
            flush=True,
        )
    rows = []
    for variant in args.variants:
        name, gpu, geometry, compiled = PIPELINE_VARIANTS[variant]
        _ensure_group()
        model = resnet50(num_classes=10)
        optimizer = sgd(model, fused=True)
        ddp = DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=True)
        # The trainer's forward: compiled from the first step here (a long job's, after its first epoch).
        forward = CompiledForward(
            ddp,
            setting="on" if compiled else "off",
            device=torch.device("cuda", 0),
            batch_size=args.batch_size,
        )
        step = train_step_fn(forward, optimizer)
        source = batches(root, args.batch_size, args.workers, args.prefetch, gpu, 0.0, geometry or "batch")
        warmup = args.compile_warmup if compiled else args.warmup
        rate, util = rate_of(source, args.batch_size, args.steps, warmup, step)
        ratio = rate / synthetic[compiled]
        rows.append([name, f"{rate:.0f}", "n/a" if util is None else f"{util:.0f} %", f"{ratio:.3f}"])
        print(f"  training, {name}: {rate:.0f} images/s ({ratio:.1%} of synthetic)", flush=True)
        del model, optimizer, ddp, forward, step, source
        torch.cuda.empty_cache()
    print(
        f"\nResNet-50 training on JPEG photos as the trainer runs it (DDP, fused SGD), batch {args.batch_size}, "
        f"{args.workers} loader workers; synthetic at the same settings: "
        + ", ".join(f"{'compiled' if c else 'eager'} {r:.0f}" for c, r in synthetic.items())
        + " images/s (each variant against the synthetic figure of its own forward):"
    )
    print(table(rows, ["training images decoded by", "images/s", "GPU util", "/ synthetic"]))


def cmd_profile(args: argparse.Namespace, device: torch.device | None = None) -> None:
    """Where a GPU-decoded batch's time goes: nvJPEG alone, the crop/resize, the loader."""
    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    from torchyard.modeldir import image_directory_samples
    from worker.trainer.data import train_transform
    from worker.trainer.gpu_decode import EncodedTrainSet, GpuDecoder, encoded_collate

    device = device or torch.device("cuda", 0)
    root = photo_set(args)
    files = sorted(str(p) for p in (root / "train").rglob("*.jpg"))[: 4 * args.batch_size]
    data = [read_file(f) for f in files]
    groups = [data[i : i + args.batch_size] for i in range(0, len(data), args.batch_size)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def rate(work: Any, images: int) -> float:
        work()
        sync()
        started = time.perf_counter()
        work()
        sync()
        return images / (time.perf_counter() - started)

    rows = []
    batched = rate(lambda: [decode_jpeg(g, mode=ImageReadMode.RGB, device=device) for g in groups], len(data))
    rows.append(["nvJPEG, batched calls, one thread", f"{batched:.0f}"])
    single = rate(
        lambda: [decode_jpeg(d, mode=ImageReadMode.RGB, device=device) for d in groups[0]], len(groups[0])
    )
    rows.append(["nvJPEG, one image a call", f"{single:.0f}"])
    cpu = rate(lambda: decode_jpeg(groups[0], mode=ImageReadMode.RGB, device="cpu"), len(groups[0]))
    rows.append(["libjpeg-turbo on the CPU, one thread", f"{cpu:.0f}"])
    decoder = GpuDecoder(device, IMAGE_SIZE, "standard")
    images = list(decode_jpeg(groups[0], mode=ImageReadMode.RGB, device=device))
    geometry = rate(lambda: [decoder._crop_resize(images) for _ in range(10)], 10 * len(images))
    rows.append(["crop boxes per batch + one roi_align (the batch geometry)", f"{geometry:.0f}"])
    previous = previous_decoder(device, IMAGE_SIZE)
    geometry = rate(lambda: [previous._crop_resize(images) for _ in range(10)], 10 * len(images))
    rows.append(["previous: crop boxes image by image + one roi_align", f"{geometry:.0f}"])
    classes = sorted(p.name for p in (root / "train").iterdir())
    dataset = EncodedTrainSet(
        image_directory_samples(str(root / "train"), classes), train_transform(IMAGE_SIZE, "standard")
    )
    for workers in sorted({4, args.workers}):
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=workers,
            collate_fn=encoded_collate,
            pin_memory=device.type == "cuda",
            persistent_workers=True,
            prefetch_factor=args.prefetch,
        )
        for label, work in (("loader alone", None), ("loader + decoder", decoder)):
            iterator = iter(loader)
            next(iterator)
            started, count = time.perf_counter(), 0
            for batch in iterator:
                if work is not None:
                    work(batch)
                count += len(batch.payloads)
            sync()
            rows.append(
                [f"{label}, {workers} loader workers", f"{count / (time.perf_counter() - started):.0f}"]
            )
    print(f"\nGPU decoding, stage by stage (JPEG photos, batch {args.batch_size}; no training):")
    print(table(rows, ["stage", "images/s"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part", nargs="?", default="all", choices=["all", "synthetic", "decode", "pipeline", "profile"]
    )
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
        "--compile",
        default="default",
        help="comma list of torch.compile modes to try after the eager sweep (default: the trainer's, 'default'); '' for none",
    )
    parser.add_argument("--compile-warmup", type=int, default=20)
    parser.add_argument("--no-ddp", action="store_true", help="also measure without the DDP wrapper")
    parser.add_argument("--data", default=None, help="JPEG ImageDirectory root (written when missing)")
    parser.add_argument("--per-class", type=int, default=400)
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: the trainer's)")
    parser.add_argument(
        "--worker-counts", default="", help="decode: loader worker counts to try (CPU decoding)"
    )
    parser.add_argument(
        "--gpu-worker-counts", default="4,8", help="decode: loader worker counts to try (GPU decoding)"
    )
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument(
        "--variants",
        default=",".join(PIPELINE_VARIANTS),
        help=f"pipeline: variants to measure, of {', '.join(PIPELINE_VARIANTS)}",
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
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in PIPELINE_VARIANTS]
    if unknown:
        parser.error(f"unknown pipeline variants: {', '.join(unknown)}")
    args.gpu_worker_counts = [int(w) for w in args.gpu_worker_counts.split(",") if w]
    print(describe_device())
    print(
        f"CPUs usable: {len(os.sched_getaffinity(0))}; loader workers (trainer default): {args.workers}",
        flush=True,
    )
    if args.part in ("all", "synthetic"):
        best = cmd_synthetic(args)
        if args.batch_size is None:
            args.batch_size = best["batch"]
    if args.batch_size is None:
        args.batch_size = 256
    if args.part in ("all", "decode"):
        cmd_decode(args)
    if args.part in ("all", "pipeline"):
        cmd_pipeline(args)
    if args.part in ("all", "profile"):
        cmd_profile(args)


if __name__ == "__main__":
    main()
