"""A small real image dataset: scikit-learn's bundled handwritten digits as PNG class folders.

1,797 8x8 greyscale scans of handwritten digits (UCI ML hand-written digits), written
as ImageDirectory folders (one sub-folder per class), split into training and
validation sets deterministically.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from PIL import Image


def write_digits(
    root: Path,
    *,
    validation_fraction: float = 0.2,
    per_class: int | None = None,
    size: int = 32,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``root/train/<digit>/*.png`` and ``root/val/<digit>/*.png``; return both folders.

    ``per_class`` caps the number of images of each class (before the split), for
    fast tests. Images are upscaled to ``size`` pixels with bilinear filtering.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images: np.ndarray = digits.images  # (n, 8, 8) values 0..16
    targets: np.ndarray = digits.target
    rng = np.random.default_rng(seed)
    train_dir, val_dir = root / "train", root / "val"
    for label in range(10):
        idx = np.flatnonzero(targets == label)
        rng.shuffle(idx)
        if per_class is not None:
            idx = idx[:per_class]
        n_val = max(1, round(len(idx) * validation_fraction))
        for split_dir, chosen in ((val_dir, idx[:n_val]), (train_dir, idx[n_val:])):
            class_dir = split_dir / str(label)
            class_dir.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                pixels = (images[i] * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
                img = Image.fromarray(pixels, mode="L").resize((size, size), Image.Resampling.BILINEAR)
                img.save(class_dir / f"digit-{int(i):04d}.png")
    return train_dir, val_dir


# Channel orders that turn one photo into visibly different classes.
_CHANNEL_ORDERS = ((0, 1, 2), (2, 1, 0), (1, 0, 2), (0, 2, 1), (1, 2, 0), (2, 0, 1))


@functools.cache
def _sample_photos() -> list[np.ndarray]:
    from sklearn.datasets import load_sample_images

    return list(load_sample_images().images)


def _photo(task: tuple[int, int, int, int, Path]) -> None:
    """One JPEG of ``write_photos``: a random crop of a bundled photo at an ImageNet-like size."""
    seed, index, label, quality, path = task
    photos = _sample_photos()
    rng = np.random.default_rng([seed, index])
    source = photos[label % len(photos)]
    order = _CHANNEL_ORDERS[(label // len(photos)) % len(_CHANNEL_ORDERS)]
    height, width = source.shape[:2]
    area = rng.uniform(0.3, 1.0) * height * width
    aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    crop_w = int(min(width, round((area * aspect) ** 0.5)))
    crop_h = int(min(height, round((area / aspect) ** 0.5)))
    top = int(rng.integers(0, height - crop_h + 1))
    left = int(rng.integers(0, width - crop_w + 1))
    pixels = source[top : top + crop_h, left : left + crop_w][..., list(order)]
    # ImageNet's typical photo: about 400-500 pixels on the long side.
    long_side = int(rng.integers(400, 501))
    scale = long_side / max(crop_w, crop_h)
    size = (max(1, round(crop_w * scale)), max(1, round(crop_h * scale)))
    image = Image.fromarray(np.ascontiguousarray(pixels)).resize(size, Image.Resampling.BILINEAR)
    image.save(path, quality=quality)


def write_photos(
    root: Path,
    *,
    classes: int = 10,
    train_per_class: int = 300,
    val_per_class: int = 50,
    quality: int = 90,
    seed: int = 0,
    workers: int = 1,
) -> tuple[Path, Path]:
    """Write a JPEG ImageDirectory of photo-sized images (``root/train``, ``root/val``).

    Each image is a random crop of one of scikit-learn's two bundled colour photos,
    rescaled to 400-500 pixels on its long side (about the size of an ImageNet photo)
    and saved as JPEG. A class is one photo with one channel order, so the labels are
    learnable; the point is a real decode-and-augment cost per image. Deterministic in
    ``seed``; ``workers`` > 1 encodes in a process pool.
    """
    if not 1 <= classes <= 2 * len(_CHANNEL_ORDERS):
        raise ValueError(f"classes must be 1..{2 * len(_CHANNEL_ORDERS)}")
    tasks: list[tuple[int, int, int, int, Path]] = []
    train_dir, val_dir = root / "train", root / "val"
    index = 0
    for split_dir, count in ((train_dir, train_per_class), (val_dir, val_per_class)):
        for label in range(classes):
            class_dir = split_dir / f"class-{label:02d}"
            class_dir.mkdir(parents=True, exist_ok=True)
            for _ in range(count):
                tasks.append((seed, index, label, quality, class_dir / f"photo-{index:06d}.jpg"))
                index += 1
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_photo, tasks, chunksize=64))
    else:
        for task in tasks:
            _photo(task)
    return train_dir, val_dir
