"""The node's cache of decoded training images (worker/trainer/image_cache.py): written once,
atomically, read back identical to decoding, shared, bounded, and the same batches as the
uncached path under the same seed."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.trainer_helpers import DIGIT_CLASSES, Digits, write_job
from torchyard.contract.files import locked
from torchyard.modeldir import image_directory_samples
from worker.trainer import image_cache
from worker.trainer.config import load_job
from worker.trainer.data import CachedImageSet, build_loaders, cached_train_set, cached_train_transform
from worker.trainer.distributed import DistEnv

SHA = "ab" * 32
SIZE = image_cache.cache_size(32)


@pytest.fixture
def samples(digits: Digits) -> list[tuple[str, int]]:
    return image_directory_samples(digits.train, DIGIT_CLASSES)


def _entry(
    root: Path, digits: Digits, samples: list[tuple[str, int]], size: int = SIZE
) -> image_cache.CacheEntry:
    return image_cache.cache_entry(root, str(digits.train), SHA, samples, size)


def test_written_once_atomically_and_read_back_as_decoded(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]]
) -> None:
    entry = _entry(tmp_path, digits, samples)
    assert SIZE == 36 and not entry.ready()
    # A writer holds the lock: nothing is written, nothing waits.
    with locked(entry.lock_file):
        assert image_cache.write_cache(entry, samples) is False
    assert not entry.folder.exists()
    # A writer killed mid-way left a temporary folder: the next one removes it.
    stale = tmp_path / f".{entry.folder.name}.tmp-999999"
    stale.mkdir()
    assert image_cache.write_cache(entry, samples) is True
    assert entry.ready() and not stale.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and "tmp" in p.name] == []
    assert image_cache.write_cache(entry, samples) is False  # written once
    pixels = entry.open_pixels()
    assert pixels.shape == (len(samples), SIZE, SIZE, 3)
    for index in (0, 7, len(samples) - 1):
        assert np.array_equal(pixels[index], image_cache.decode_resized(samples[index][0], SIZE))
    labels = np.load(entry.folder / image_cache.LABELS_FILE)
    assert labels.tolist() == [target for _, target in samples]


def test_entries_are_shared_by_dataset_and_size(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]]
) -> None:
    first, again = _entry(tmp_path, digits, samples), _entry(tmp_path, digits, list(samples))
    assert first == again
    assert _entry(tmp_path, digits, samples, size=SIZE + 1).folder != first.folder
    assert (
        image_cache.cache_entry(tmp_path, str(digits.train), "cd" * 32, samples, SIZE).folder != first.folder
    )
    # The agent's layout: <work>/datasets/<sha256>/... caches in <work>/image-cache.
    data_root = tmp_path / "work" / "datasets" / SHA / "train"
    data_root.mkdir(parents=True)
    assert image_cache.cache_root(str(data_root), SHA) == tmp_path / "work" / "image-cache"
    assert image_cache.cache_root(str(digits.train), SHA) is None


def test_too_small_a_bound_writes_nothing_and_still_gives_pixels(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(image_cache.ENV_MAX_GB, "0.000001")
    entry = _entry(tmp_path, digits, samples)
    ok, why = image_cache.fits(entry)
    assert not ok and image_cache.ENV_MAX_GB in why
    assert image_cache.write_cache(entry, samples) is False
    assert not entry.folder.exists()
    dataset = CachedImageSet(samples, SIZE, cached_train_transform(32, "light"), entry)
    image, target = dataset[3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and target == samples[3][1]


def test_the_writer_process_writes_the_cache(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]]
) -> None:
    entry = _entry(tmp_path, digits, samples[:20])
    image_cache.start_writer(entry, samples[:20])
    deadline = time.monotonic() + 30
    while not entry.ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry.ready()
    assert np.array_equal(entry.open_pixels()[5], image_cache.decode_resized(samples[5][0], SIZE))


def _epoch_batches(
    loader: torch.utils.data.DataLoader, sampler: torch.utils.data.DistributedSampler, epoch: int
) -> list[torch.Tensor]:  # type: ignore[type-arg]
    sampler.set_epoch(epoch)
    return [images for images, _ in loader]


def test_cached_batches_equal_the_uncached_ones(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = load_job(write_job(tmp_path / "run", digits, augmentation="standard", loader_workers=0))
    assert job.datasets is not None
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_name="test-node")
    cpu = torch.device("cpu")
    uncached = build_loaders(job, env, cpu)
    assert isinstance(uncached.train.dataset.inner, CachedImageSet)  # type: ignore[attr-defined]
    assert uncached.train.dataset.inner.entry is None  # type: ignore[attr-defined]

    monkeypatch.setenv(image_cache.ENV_DIR, str(tmp_path / "cache"))
    entry = image_cache.cache_entry(
        tmp_path / "cache", job.train_dir, job.datasets.train.sha256, samples, image_cache.cache_size(32)
    )
    assert image_cache.write_cache(entry, samples)
    cached = build_loaders(job, env, cpu)
    assert cached.train.dataset.inner.entry == entry  # type: ignore[attr-defined]
    for epoch in (0, 1):
        expected = _epoch_batches(uncached.train, uncached.train_sampler, epoch)
        got = _epoch_batches(cached.train, cached.train_sampler, epoch)
        assert len(got) == len(expected) > 0
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert not torch.equal(got[0], _epoch_batches(cached.train, cached.train_sampler, 0)[0])


def test_the_switch_restores_crops_of_the_original(
    tmp_path: Path, digits: Digits, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(image_cache.ENV_SWITCH, "0")
    job = load_job(write_job(tmp_path / "run", digits, loader_workers=0))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_name="test-node")
    loaders = build_loaders(job, env, torch.device("cpu"))
    assert not isinstance(loaders.train.dataset.inner, CachedImageSet)  # type: ignore[attr-defined]


def test_a_folder_that_cannot_be_written_means_no_cache(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(image_cache.ENV_DIR, str(blocker / "cache"))
    job = load_job(write_job(tmp_path / "run", digits, loader_workers=0))
    dataset = cached_train_set(job, samples, write=True)
    assert dataset.entry is None
    assert dataset[0][0].shape == (3, 32, 32)
