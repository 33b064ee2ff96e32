"""Input pipeline: ImageDirectory datasets, augmentation, samplers and loaders.

Images are decoded and cropped in the loader (PIL), handed over as uint8 tensors and
normalized on the training device (:func:`torchyard.modeldir.normalize_batch`): a
uint8 batch is four times lighter to pin and copy than a float one.

Training images are decoded once per node into a memory-mapped cache at a size a bit
larger than the training resolution, and every epoch crops and flips them from there, a
batch at a time on the GPU where there is one (:class:`CachedCrops`), one image at a time
by the loader workers on a CPU node (:func:`crop_each`); each sample's box and flip drawn in the loader from the job's
seed, so the random stream is the same on every device); validation images are cached as the evaluation transform's pixels
(:mod:`worker.trainer.image_cache` says what that changes in the augmentation).
``TORCHYARD_IMAGE_CACHE=0`` crops the original images as before.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from torchyard.contract.errors import InvalidDatasetError
from torchyard.contract.jobspec import Augmentation
from torchyard.modeldir import eval_geometry, image_directory_samples, load_rgb_image
from worker.trainer import image_cache
from worker.trainer.config import JobConfig
from worker.trainer.distributed import DistEnv
from worker.trainer.gpu_decode import (
    CROP_POLICY,
    EncodedTrainSet,
    GpuDecoder,
    cpu_share,
    crop_boxes,
    encoded_collate,
    gpu_decode_wanted,
    gpu_decode_works,
)
from worker.trainer.seeding import derive_seed, ignored_signals, init_loader_worker

log = logging.getLogger(__name__)


class SeededSamples(Dataset[Any]):
    """A training set whose random augmentation of each sample is a pure function of the
    job's seed, the epoch and the sample: ``dataset[(index, seed)]`` runs ``inner[index]``
    with torch's CPU generator seeded by ``seed`` (and restores the generator after).

    The data then does not depend on the number of loader workers nor on where an
    epoch was interrupted: a resumed epoch sees the same crops and flips.
    """

    def __init__(self, inner: Dataset[Any]) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        generator = torch.default_generator
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            return self.inner[index]
        finally:
            generator.set_state(saved)


class ResumableSampler(DistributedSampler[Any]):
    """The shuffling ``DistributedSampler`` of the training set, yielding ``(index, seed)``
    for :class:`SeededSamples`; ``skip`` samples are left out of the next pass (a mid-epoch
    resume)."""

    def __init__(self, dataset: Dataset[Any], *, num_replicas: int, rank: int, seed: int, augment_seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.augment_seed = augment_seed
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        epoch = self.epoch
        for index in indices[skip:]:
            yield (index, derive_seed(self.augment_seed, epoch, index))


class ImageDataset(Dataset[tuple[torch.Tensor, int]]):
    """``(path, class index)`` samples decoded as RGB and transformed to uint8 CHW tensors."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Callable[[Image.Image], torch.Tensor]):
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[index]
        return self.transform(load_rgb_image(path)), target


class CachedImageSet(Dataset[tuple[torch.Tensor, int]]):
    """Samples in a cache geometry as uint8 CHW tensors: the row of the node's image cache
    once it is complete, else the file decoded and resized on the fly
    (:func:`image_cache.decode_resized`: the same pixels). ``crop``: the centre square kept
    (the evaluation transform's pixels for validation); ``None`` keeps the ``size`` square."""

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        size: int,
        entry: image_cache.CacheEntry | None = None,
        crop: int | None = None,
    ) -> None:
        self.samples = list(samples)
        self.size = size
        self.entry = entry
        self.crop = crop
        self._pixels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pixels"] = None  # each loader worker maps the file itself
        return state

    def pixels(self, index: int) -> np.ndarray:
        """``side x side x 3`` uint8 pixels of a sample."""
        if self._pixels is None and self.entry is not None and self.entry.ready():
            self._pixels = self.entry.open_pixels()
        if self._pixels is not None:
            return np.array(self._pixels[index])
        return image_cache.decode_resized(self.samples[index][0], self.size, self.crop)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.pixels(index)).permute(2, 0, 1), self.samples[index][1]


class CachedTrainSet(CachedImageSet):
    """Training samples in the cache geometry, with the random crop and flip to apply:
    ``(pixels, box, flip, target)``, ``pixels`` the uint8 CHW ``size`` square, ``box``
    ``(left, top, width, height)`` (float64) and ``flip`` a bool tensor, drawn here with
    torch's CPU generator (:func:`worker.trainer.gpu_decode.crop_boxes`, torchvision's
    ``RandomResizedCrop`` rule), so that :class:`SeededSamples` makes them a function of
    the seed, the epoch and the sample whatever the training device. The crops themselves
    are made a batch at a time on the GPU (:class:`CachedCrops`), or by the loader as it
    collates a batch on a CPU node (:func:`crop_each`)."""

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        size: int,
        augmentation: Augmentation,
        entry: image_cache.CacheEntry | None = None,
    ) -> None:
        if augmentation not in (*CROP_POLICY, "none"):
            raise ValueError(f"unknown augmentation {augmentation!r}")
        super().__init__(samples, size, entry)
        self.augmentation = augmentation
        self._shape = torch.tensor([[size, size]], dtype=torch.int64)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:  # type: ignore[override]
        image, target = super().__getitem__(index)
        boxes, flips = crop_boxes(self._shape, self.augmentation)
        return image, boxes[0], flips[0], target


def crop_batch(
    pixels: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, image_size: int
) -> torch.Tensor:
    """uint8 ``(N, 3, image_size, image_size)`` crops of uint8 ``(N, 3, S, S)`` pixels, on
    their device: each ``box`` (``(N, 4)``: left, top, width, height) resized to
    ``image_size`` by one ``roi_align`` call (bilinear, the adaptive sampling averaging
    every source pixel of an output pixel when shrinking) and the ``flips`` mirrored."""
    from torchvision.ops import roi_align

    device = pixels.device
    boxes = boxes.to(torch.float64)
    corners = torch.cat([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], dim=1)  # x1, y1, x2, y2
    index = torch.arange(boxes.shape[0], dtype=torch.float64)[:, None]
    rois = torch.cat([index, corners], dim=1).to(device, torch.float32)
    crops = roi_align(
        pixels.to(torch.float32),
        rois,
        output_size=(image_size, image_size),
        spatial_scale=1.0,
        sampling_ratio=-1,
        aligned=True,
    )
    crops = torch.where(flips.to(device).view(-1, 1, 1, 1), crops.flip(-1), crops)
    return crops.round_().clamp_(0, 255).to(torch.uint8)


class CachedCrops:
    """A loader batch of :class:`CachedTrainSet` to the training batch on ``device``: the
    pixels copied there and cropped, resized and flipped as one batch (:func:`crop_batch`);
    ``(uint8 images, targets)`` on the device."""

    def __init__(self, device: torch.device, image_size: int) -> None:
        self.device = device
        self.image_size = image_size

    def __call__(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        pixels, boxes, flips, targets = batch
        images = crop_batch(pixels.to(self.device, non_blocking=True), boxes, flips, self.image_size)
        return images, targets.to(self.device, non_blocking=True)


def _entry_in_use(
    root: Path,
    data_dir: str,
    sha256: str | None,
    samples: Sequence[tuple[str, int]],
    size: int,
    crop: int | None = None,
) -> image_cache.CacheEntry | None:
    """The entry of these samples, marked as used by this process, when it is there or
    may be written; None when it cannot be cached."""
    entry = image_cache.cache_entry(root, data_dir, sha256, samples, size, crop=crop)
    image_cache.mark_in_use(entry)
    if entry.ready():
        log.info("image cache: reading %s", entry.folder)
        return entry
    ok, why = image_cache.fits(entry)
    if not ok:
        log.info("image cache: %s not written (%s): decoding every epoch", entry.folder.name, why)
        return None
    return entry


def _cached(
    job: JobConfig, data_dir: str, sha256: str | None, samples: Sequence[tuple[str, int]], crop: int | None
) -> image_cache.CacheEntry | None:
    size = image_cache.cache_size(job.parameters.image_size)
    root = image_cache.cache_root(data_dir, sha256)
    if root is None:
        log.info("image cache: none for a dataset outside the node's dataset cache: decoding every epoch")
        return None
    try:
        return _entry_in_use(root, data_dir, sha256, samples, size, crop)
    except OSError as exc:  # a folder this rank cannot write: train without the cache
        log.warning("image cache: unusable (%s): decoding every epoch", exc)
        return None


def cached_train_set(job: JobConfig, samples: Sequence[tuple[str, int]], *, write: bool) -> CachedTrainSet:
    """The training set in the cache geometry; ``write``: start the node's cache writer
    when the cache is missing and fits (local rank 0)."""
    sets = cached_sets(job, samples, [], write=write)
    return sets[0]


def cached_sets(
    job: JobConfig,
    train_samples: Sequence[tuple[str, int]],
    val_samples: Sequence[tuple[str, int]],
    *,
    write: bool,
) -> tuple[CachedTrainSet, CachedImageSet]:
    """The training set in the cache geometry and the validation set as the evaluation
    transform's pixels, both read from the node's image cache where it has them;
    ``write``: start the node's cache writer for the missing entries that fit (local rank 0)."""
    params = job.parameters
    size = image_cache.cache_size(params.image_size)
    datasets = job.datasets
    train_sha = datasets.train.sha256 if datasets is not None else None
    val_sha = datasets.validation.sha256 if datasets is not None else None
    train_entry = _cached(job, job.train_dir, train_sha, train_samples, None)
    val_entry = _cached(job, job.val_dir, val_sha, val_samples, params.image_size) if val_samples else None
    missing = [
        (entry, samples)
        for entry, samples in ((train_entry, train_samples), (val_entry, val_samples))
        if entry is not None and not entry.ready()
    ]
    if write and missing:
        log.info("image cache: writing %s during training", ", ".join(e.folder.name for e, _ in missing))
        image_cache.start_writer(missing)
    return (
        CachedTrainSet(train_samples, size, params.augmentation, train_entry),
        CachedImageSet(val_samples, size, val_entry, crop=params.image_size),
    )


def _geometry_steps(image_size: int, augmentation: Augmentation) -> list[Callable[..., object]]:
    if augmentation == "standard":
        # The ImageNet recipe, for photos.
        return [T.RandomResizedCrop(image_size, antialias=True), T.RandomHorizontalFlip()]
    if augmentation == "light":
        # Mild scale/aspect jitter and no flip: for digits, text and scans a mirror image
        # is another symbol.
        return [T.RandomResizedCrop(image_size, scale=(0.8, 1.0), ratio=(0.9, 1.1), antialias=True)]
    if augmentation == "none":
        return [T.Resize(image_size, antialias=True), T.CenterCrop(image_size)]
    raise ValueError(f"unknown augmentation {augmentation!r}")


def train_transform(image_size: int, augmentation: Augmentation) -> T.Compose:
    """Training geometry for an augmentation level (uint8 CHW output)."""
    return T.Compose([*_geometry_steps(image_size, augmentation), T.PILToTensor()])


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """This rank's share of ``n`` items: each index on exactly one rank, no padding."""
    return list(range(rank, n, world_size))


def default_loader_workers(device: torch.device, local_world_size: int) -> int:
    """Loader processes per rank: enough to feed a GPU; few on a CPU node, where the
    workers would compete with the training threads for the same cores."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    per_rank = max(1, cpus // max(1, local_world_size))
    if device.type == "cuda":
        return min(16, max(1, per_rank - 1))
    return max(0, min(2, per_rank - 1))


@dataclass
class Loaders:
    train: DataLoader[Any]
    train_sampler: ResumableSampler
    val: DataLoader[tuple[torch.Tensor, int]]
    num_train: int
    num_val: int
    workers: int
    generator: torch.Generator
    # Turns a training loader batch into uint8 device pixels and targets where the crops are
    # made on the GPU (cached pixels: CachedCrops; GPU decoding: GpuDecoder); None: the
    # loader's batches are the images.
    on_device: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train)


def _sets(
    job: JobConfig,
    env: DistEnv,
    device: torch.device,
    train_samples: Sequence[tuple[str, int]],
    val_samples: Sequence[tuple[str, int]],
) -> tuple[
    Dataset[Any],
    CachedImageSet | ImageDataset,
    Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None,
    str,
]:
    """The training set (before :class:`SeededSamples`), the validation set, what turns a
    training loader batch into device pixels (``None``: the loader's uint8 images), and how
    the training images are handled (for the log)."""
    params = job.parameters
    if image_cache.cache_wanted():
        train_set, val_set = cached_sets(job, train_samples, val_samples, write=env.local_rank == 0)
        if device.type == "cpu":
            # The same crops on the CPU: made by the loader workers, beside the training step.
            return (
                train_set,
                val_set,
                None,
                "read in the image cache geometry, cropped and flipped in the loader",
            )
        return (
            train_set,
            val_set,
            CachedCrops(device, params.image_size),
            f"read in the image cache geometry, cropped and flipped a batch at a time on {device.type}",
        )
    val = ImageDataset(val_samples, eval_geometry(params.image_size))
    transform = train_transform(params.image_size, params.augmentation)
    has_jpeg = any(path.lower().endswith((".jpg", ".jpeg")) for path, _ in train_samples)
    if has_jpeg and device.type == "cuda" and gpu_decode_wanted() and gpu_decode_works(device):
        decoder = GpuDecoder(device, params.image_size, params.augmentation)
        return (
            EncodedTrainSet(train_samples, transform, cpu_share()),
            val,
            decoder,
            "decoded on the GPU (nvJPEG; other formats in the loader workers)",
        )
    return ImageDataset(train_samples, transform), val, None, "decoded in the loader workers"


def _train_collate(
    train_set: Dataset[Any], on_device: Callable[[Any], Any] | None, image_size: int
) -> Callable[[list[Any]], Any] | None:
    """How the training loader collates: JPEG payloads for the GPU decoder, cached pixels
    cropped in the loader (:func:`crop_each`) when the training device does not crop
    them, else torch's default."""
    if isinstance(on_device, GpuDecoder):
        return encoded_collate
    if isinstance(train_set, CachedTrainSet) and on_device is None:
        return functools.partial(crop_each, image_size)
    return None


def crop_each(image_size: int, items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of :class:`CachedTrainSet` items cropped on the CPU, the crops of
    :func:`crop_batch` (the same boxes and flips) made one image at a time with
    torchvision's antialiased uint8 resize: on a CPU, 3-4x faster than ``roi_align``
    (bench/RESULTS.md), and within a few levels of its pixels."""
    images = torch.empty((len(items), 3, image_size, image_size), dtype=torch.uint8)
    for slot, (pixels, box, flip, _) in enumerate(items):
        left, top, width, height = (int(v) for v in box.tolist())
        crop = TF.resized_crop(pixels, top, left, height, width, [image_size, image_size], antialias=True)
        images[slot] = TF.horizontal_flip(crop) if bool(flip) else crop
    return images, torch.tensor([item[3] for item in items], dtype=torch.int64)


def build_loaders(job: JobConfig, env: DistEnv, device: torch.device, start_epoch: int = 0) -> Loaders:
    """Datasets, samplers and loaders of this rank.

    Training: a shuffling ``DistributedSampler`` (seeded from ``random_seed``; call
    ``set_epoch``) and ``drop_last`` batches, so every rank runs the same number of
    iterations and no batch of one image reaches BatchNorm. Validation: a plain shard
    ``range(rank, n, world_size)``, so the ranks together see every image exactly once.
    """
    params = job.parameters
    train_samples = image_directory_samples(job.train_dir, job.classes)
    val_samples = image_directory_samples(job.val_dir, job.classes)
    per_rank = -(-len(train_samples) // env.world_size)
    if per_rank < 2:
        raise InvalidDatasetError(
            f"the training set has {len(train_samples)} images: too few for {env.world_size} processes"
        )

    train_set, val_set, on_device, pipeline = _sets(job, env, device, train_samples, val_samples)
    val_shard = torch.utils.data.Subset(val_set, shard_indices(len(val_set), env.rank, env.world_size))

    train_set = SeededSamples(train_set)
    sampler = ResumableSampler(
        train_set,
        num_replicas=env.world_size,
        rank=env.rank,
        seed=derive_seed(params.random_seed, "sampler"),
        augment_seed=derive_seed(params.random_seed, "augment"),
    )
    workers = (
        job.loader_workers
        if job.loader_workers is not None
        else default_loader_workers(device, env.local_world_size)
    )
    # Seeded per rank and per starting epoch: loader workers get distinct, reproducible streams.
    generator = torch.Generator()
    generator.manual_seed(derive_seed(params.random_seed, "loader", env.rank, start_epoch))
    common: dict[str, object] = {
        "num_workers": workers,
        "pin_memory": device.type == "cuda",
        "worker_init_fn": functools.partial(init_loader_worker, ignored=ignored_signals()),
        "generator": generator,
    }
    if workers > 0:
        common["persistent_workers"] = True
        common["prefetch_factor"] = 4 if device.type == "cuda" else 2
    train_loader = DataLoader(
        train_set,
        batch_size=params.batch_size,
        sampler=sampler,
        drop_last=per_rank >= params.batch_size,
        collate_fn=_train_collate(train_set.inner, on_device, params.image_size),
        **common,  # type: ignore[arg-type]
    )
    val_loader = DataLoader(val_shard, batch_size=params.batch_size, shuffle=False, **common)  # type: ignore[arg-type]
    log.info(
        "data: %d training images, %d validation images (%d on this rank), %d classes, %d loader workers, "
        "%d steps/epoch, training images %s",
        len(train_samples),
        len(val_set),
        len(val_shard),
        job.num_classes,
        workers,
        len(train_loader),
        pipeline,
    )
    return Loaders(
        train=train_loader,
        train_sampler=sampler,
        val=val_loader,
        num_train=len(train_samples),
        num_val=len(val_set),
        workers=workers,
        generator=generator,
        on_device=on_device,
    )
