"""A small real image dataset: scikit-learn's bundled handwritten digits as PNG class folders.

1,797 8x8 greyscale scans of handwritten digits (UCI ML hand-written digits), written
as ImageDirectory folders (one sub-folder per class), split into training and
validation sets deterministically.
"""

from __future__ import annotations

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
