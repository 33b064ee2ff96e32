"""The node's cache of decoded training images (worker/trainer/image_cache.py): written once,
atomically, read back identical to decoding, shared, bounded, and the same batches as the
uncached path under the same seed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import default_collate

from tests.support.trainer_helpers import DIGIT_CLASSES, Digits, epoch_history, run_in_process, write_job
from torchyard.contract.files import locked
from torchyard.modeldir import eval_geometry, image_directory_samples, load_rgb_image
from worker.trainer import image_cache
from worker.trainer.config import load_job
from worker.trainer.data import (
    CachedCrops,
    CachedTrainSet,
    Loaders,
    build_loaders,
    cached_train_set,
    crop_batch,
)
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
    dataset = CachedTrainSet(samples, SIZE, "light", entry)
    pixels, box, flip, target = dataset[3]
    assert pixels.shape == (3, SIZE, SIZE) and pixels.dtype == torch.uint8 and target == samples[3][1]
    image = crop_batch(pixels[None], box[None], flip[None], 32)
    assert image.shape == (1, 3, 32, 32) and image.dtype == torch.uint8


def test_the_writer_process_writes_the_cache(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]]
) -> None:
    entry = _entry(tmp_path, digits, samples[:20])
    image_cache.start_writer([(entry, samples[:20])])
    deadline = time.monotonic() + 30
    while not entry.ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry.ready()
    assert np.array_equal(entry.open_pixels()[5], image_cache.decode_resized(samples[5][0], SIZE))


def _epoch_batches(loaders: Loaders, epoch: int) -> list[torch.Tensor]:
    """The epoch's training images as the training step gets them (on the CPU: cropped by the loader)."""
    assert loaders.on_device is None
    loaders.train_sampler.set_epoch(epoch)
    return [images for images, _ in loaders.train]


def test_cached_batches_equal_the_uncached_ones(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = load_job(write_job(tmp_path / "run", digits, augmentation="standard", loader_workers=0))
    assert job.datasets is not None
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_name="test-node")
    cpu = torch.device("cpu")
    uncached = build_loaders(job, env, cpu)
    assert isinstance(uncached.train.dataset.inner, CachedTrainSet)  # type: ignore[attr-defined]
    assert uncached.train.dataset.inner.entry is None  # type: ignore[attr-defined]

    monkeypatch.setenv(image_cache.ENV_DIR, str(tmp_path / "cache"))
    entry = image_cache.cache_entry(
        tmp_path / "cache", job.train_dir, job.datasets.train.sha256, samples, image_cache.cache_size(32)
    )
    assert image_cache.write_cache(entry, samples)
    cached = build_loaders(job, env, cpu)
    assert cached.train.dataset.inner.entry == entry  # type: ignore[attr-defined]
    for epoch in (0, 1):
        expected = _epoch_batches(uncached, epoch)
        got = _epoch_batches(cached, epoch)
        assert len(got) == len(expected) > 0
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert not torch.equal(got[0], _epoch_batches(cached, 0)[0])


def test_the_switch_restores_crops_of_the_original(
    tmp_path: Path, digits: Digits, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(image_cache.ENV_SWITCH, "0")
    job = load_job(write_job(tmp_path / "run", digits, loader_workers=0))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_name="test-node")
    loaders = build_loaders(job, env, torch.device("cpu"))
    assert not isinstance(loaders.train.dataset.inner, CachedTrainSet)  # type: ignore[attr-defined]


def test_a_folder_that_cannot_be_written_means_no_cache(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(image_cache.ENV_DIR, str(blocker / "cache"))
    job = load_job(write_job(tmp_path / "run", digits, loader_workers=0))
    dataset = cached_train_set(job, samples, write=True)
    assert dataset.entry is None
    assert dataset[0][0].shape == (3, SIZE, SIZE)


def _written(
    root: Path, digits: Digits, samples: list[tuple[str, int]], sha: str, size: int
) -> image_cache.CacheEntry:
    entry = image_cache.cache_entry(root, str(digits.train), sha, samples, size)
    assert image_cache.write_cache(entry, samples)
    return entry


def _last_used(entry: image_cache.CacheEntry, seconds_ago: float) -> None:
    stamp = time.time() - seconds_ago
    os.utime(entry.use_file, (stamp, stamp))


def test_the_least_recently_used_entry_not_in_use_is_evicted(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    few = samples[:20]
    old = _written(tmp_path, digits, few, "a1" * 32, 36)  # 77,760 bytes
    used = _written(tmp_path, digits, few, "b2" * 32, 40)  # 96,000 bytes
    # Room for the two, not for a third: another dataset at 36 px evicts one.
    monkeypatch.setenv(image_cache.ENV_MAX_GB, str(200_000 / 1e9))
    image_cache.mark_in_use(used)  # a running job's
    try:
        _last_used(used, 300)  # used least recently, but in use
        _last_used(old, 200)
        new = _written(tmp_path, digits, few, "c3" * 32, 36)
        assert new.ready() and used.ready()
        assert not old.folder.exists()
        assert not [p for p in tmp_path.iterdir() if "evicted" in p.name]
        # What is left is in use: nothing more goes, and the next entry is not written.
        image_cache.mark_in_use(new)
        refused = image_cache.cache_entry(tmp_path, str(digits.train), "d4" * 32, few, 36)
        ok, why = image_cache.make_room(refused)
        assert not ok and "in use" in why
        assert image_cache.write_cache(refused, few) is False
        assert new.ready() and used.ready() and not refused.folder.exists()
        # Once the job ends, its entries may go.
        image_cache.release(used)
        image_cache.release(new)
        assert image_cache.write_cache(refused, few) is True
        assert refused.ready() and not used.folder.exists() and new.ready()
    finally:
        image_cache.release(used)
        image_cache.release(new)


def test_the_validation_pixels_are_those_of_the_evaluation_transform(tmp_path: Path, digits: Digits) -> None:
    paths = [image_directory_samples(digits.val, DIGIT_CLASSES)[0][0]]
    rng = np.random.default_rng(3)
    for width, height in ((50, 37), (37, 50), (101, 64), (64, 64)):
        path = tmp_path / f"{width}x{height}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    for image_size in (32, 64, 30):  # 36, 73 (an odd margin) and 34 px resized
        geometry = eval_geometry(image_size)
        size = image_cache.cache_size(image_size)
        for path in paths:
            expected = geometry(load_rgb_image(path)).permute(1, 2, 0).numpy()
            assert np.array_equal(image_cache.decode_resized(path, size, crop=image_size), expected), (
                path,
                image_size,
            )


ARCHITECTURE = "squeezenet1_1"


def test_validation_is_cached_with_the_metrics_of_an_uncached_run(
    tmp_path: Path, digits: Digits, single_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    uncached = tmp_path / "uncached"
    # SqueezeNet: the two runs in a fifth of resnet18's CPU time (their metrics are compared,
    # whatever the network).
    assert run_in_process(write_job(uncached, digits, architecture=ARCHITECTURE, epochs=2)) == 0
    # The same job with both caches written before it starts: every epoch reads them.
    cache = tmp_path / "cache"
    monkeypatch.setenv(image_cache.ENV_DIR, str(cache))
    job = load_job(write_job(tmp_path / "cached", digits, architecture=ARCHITECTURE, epochs=2))
    assert job.datasets is not None
    size = image_cache.cache_size(32)
    train = image_directory_samples(job.train_dir, job.classes)
    val = image_directory_samples(job.val_dir, job.classes)
    train_entry = image_cache.cache_entry(cache, job.train_dir, job.datasets.train.sha256, train, size)
    val_entry = image_cache.cache_entry(
        cache, job.val_dir, job.datasets.validation.sha256, val, size, crop=32
    )
    assert val_entry.folder != train_entry.folder
    assert image_cache.write_cache(train_entry, train) and image_cache.write_cache(val_entry, val)
    assert val_entry.open_pixels().shape == (len(val), 32, 32, 3)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_name="test-node")
    loaders = build_loaders(job, env, torch.device("cpu"))
    assert loaders.val.dataset.dataset.entry == val_entry  # type: ignore[attr-defined]
    assert run_in_process(tmp_path / "cached" / "job.json") == 0
    assert epoch_history(tmp_path / "cached") == epoch_history(uncached)


def test_crops_on_the_device_are_seeded_per_sample_and_resume_exactly(
    tmp_path: Path, digits: Digits, samples: list[tuple[str, int]]
) -> None:
    job = load_job(
        write_job(tmp_path / "run", digits, augmentation="standard", loader_workers=0, batch_size=16)
    )
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_name="test-node")
    cpu = torch.device("cpu")
    first = build_loaders(job, env, cpu)
    # The loader's samples: the cached square, each with its box and flip drawn from the seed.
    first.train_sampler.set_epoch(0)
    keys = list(first.train_sampler)[:16]
    items = [first.train.dataset[key] for key in keys]
    pixels, box, flip, _ = items[0]
    assert pixels.shape == (3, SIZE, SIZE) and box.shape == (4,) and flip.dtype == torch.bool
    # On the CPU the loader crops each image; a GPU's step crops the same boxes and flips as
    # one batch (roi_align, here on CPU tensors): the same pixels but for resampling rounding.
    loader_batch, targets = first.train.collate_fn(items)  # type: ignore[misc]
    device_batch, device_targets = CachedCrops(cpu, 32)(default_collate(items))
    assert device_batch.shape == loader_batch.shape == (16, 3, 32, 32) and torch.equal(
        targets, device_targets
    )
    assert (device_batch.float() - loader_batch.float()).abs().mean() < 2.0
    epoch0, epoch1 = _epoch_batches(first, 0), _epoch_batches(first, 1)
    assert epoch0[0].shape == (16, 3, 32, 32) and epoch0[0].dtype == torch.uint8
    assert torch.equal(epoch0[0], loader_batch)
    assert not torch.equal(epoch0[0], epoch1[0])
    # The same seed: the same batches, with loader workers or without.
    again = build_loaders(job.model_copy(update={"loader_workers": 2}), env, cpu)
    assert all(torch.equal(a, b) for a, b in zip(_epoch_batches(again, 1), epoch1, strict=True))
    # A run resumed mid-epoch 1 (3 batches done) by a new process gets the rest of that epoch.
    resumed = build_loaders(job, env, cpu, start_epoch=1)
    resumed.train_sampler.skip = 3 * 16
    rest = _epoch_batches(resumed, 1)
    assert len(rest) == len(epoch1) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, epoch1[3:], strict=True))
    # Another seed, other crops.
    other = build_loaders(
        job.model_copy(update={"parameters": job.parameters.model_copy(update={"random_seed": 2})}), env, cpu
    )
    assert not torch.equal(_epoch_batches(other, 0)[0], epoch0[0])
