"""Input pipeline: ImageDirectory datasets, augmentation, samplers and loaders.

Images are decoded and cropped in the loader (PIL), handed over as uint8 tensors and
normalized on the training device (:func:`torchyard.modeldir.normalize_batch`): a
uint8 batch is four times lighter to pin and copy than a float one.

Training images are decoded once per node into a memory-mapped cache at a size a bit
larger than the training resolution, and cropped and flipped from there in every epoch
(:mod:`worker.trainer.image_cache` says what that changes in the augmentation);
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

from torchyard.contract.errors import InvalidDatasetError
from torchyard.contract.jobspec import Augmentation
from torchyard.modeldir import eval_geometry, image_directory_samples, load_rgb_image
from worker.trainer import image_cache
from worker.trainer.config import JobConfig
from worker.trainer.distributed import DistEnv
from worker.trainer.gpu_decode import (
    EncodedTrainSet,
    GpuDecoder,
    cpu_share,
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
    """Training samples in the cache geometry, transformed to uint8 CHW tensors: the row
    of the node's image cache once it is complete, else the file decoded and resized on
    the fly (:func:`image_cache.decode_resized`: the same pixels), then ``transform``
    (:func:`cached_train_transform`) in the loader worker."""

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        size: int,
        transform: Callable[[torch.Tensor], torch.Tensor],
        entry: image_cache.CacheEntry | None = None,
    ) -> None:
        self.samples = list(samples)
        self.size = size
        self.transform = transform
        self.entry = entry
        self._pixels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pixels"] = None  # each loader worker maps the file itself
        return state

    def pixels(self, index: int) -> np.ndarray:
        """``size x size x 3`` uint8 pixels of a sample."""
        if self._pixels is None and self.entry is not None and self.entry.ready():
            self._pixels = self.entry.open_pixels()
        if self._pixels is not None:
            return np.array(self._pixels[index])
        return image_cache.decode_resized(self.samples[index][0], self.size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = torch.from_numpy(self.pixels(index)).permute(2, 0, 1)
        return self.transform(image), self.samples[index][1]


def cached_train_transform(image_size: int, augmentation: Augmentation) -> T.Compose:
    """Training geometry on cached pixels (uint8 CHW tensors in and out): the steps of
    :func:`train_transform`, applied to the ``image_cache.cache_size`` square instead of
    the original image."""
    return T.Compose(_geometry_steps(image_size, augmentation))


def _cache_entry(
    root: Path,
    job: JobConfig,
    sha256: str | None,
    samples: Sequence[tuple[str, int]],
    size: int,
    *,
    write: bool,
) -> image_cache.CacheEntry | None:
    entry = image_cache.cache_entry(root, job.train_dir, sha256, samples, size)
    if entry.ready():
        log.info("image cache: reading %s", entry.folder)
        return entry
    ok, why = image_cache.fits(entry)
    if not ok:
        log.info("image cache: not written (%s): decoding every epoch", why)
        return None
    if write:
        log.info("image cache: writing %s during training", entry.folder)
        image_cache.start_writer(entry, samples)
    return entry


def cached_train_set(job: JobConfig, samples: Sequence[tuple[str, int]], *, write: bool) -> CachedImageSet:
    """The training set in the cache geometry; ``write``: start the node's cache writer
    when the cache is missing and fits (local rank 0)."""
    params = job.parameters
    size = image_cache.cache_size(params.image_size)
    sha256 = job.datasets.train.sha256 if job.datasets is not None else None
    root = image_cache.cache_root(job.train_dir, sha256)
    entry = None
    if root is None:
        log.info("image cache: none for a dataset outside the node's dataset cache: decoding every epoch")
    else:
        try:
            entry = _cache_entry(root, job, sha256, samples, size, write=write)
        except OSError as exc:  # a folder this rank cannot write: train without the cache
            log.warning("image cache: unusable (%s): decoding every epoch", exc)
    return CachedImageSet(
        samples, size, cached_train_transform(params.image_size, params.augmentation), entry
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
    # Set when training images are decoded on the GPU: turns a loader batch into device pixels.
    gpu_decoder: GpuDecoder | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train)


def _train_set(
    job: JobConfig, env: DistEnv, device: torch.device, samples: Sequence[tuple[str, int]]
) -> tuple[Dataset[Any], GpuDecoder | None, str]:
    """The training set (before :class:`SeededSamples`), the GPU decoder when images are
    decoded on the GPU, and how the images are handled (for the log)."""
    params = job.parameters
    if image_cache.cache_wanted():
        dataset = cached_train_set(job, samples, write=env.local_rank == 0)
        return dataset, None, "cropped from the image cache geometry in the loader workers"
    transform = train_transform(params.image_size, params.augmentation)
    has_jpeg = any(path.lower().endswith((".jpg", ".jpeg")) for path, _ in samples)
    if has_jpeg and device.type == "cuda" and gpu_decode_wanted() and gpu_decode_works(device):
        decoder = GpuDecoder(device, params.image_size, params.augmentation)
        return (
            EncodedTrainSet(samples, transform, cpu_share()),
            decoder,
            "decoded on the GPU (nvJPEG; other formats in the loader workers)",
        )
    return ImageDataset(samples, transform), None, "decoded in the loader workers"


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

    train_set, gpu_decoder, pipeline = _train_set(job, env, device, train_samples)
    val_set = ImageDataset(val_samples, eval_geometry(params.image_size))
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
        collate_fn=encoded_collate if gpu_decoder is not None else None,
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
        gpu_decoder=gpu_decoder,
    )
