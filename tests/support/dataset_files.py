"""Builders of dataset folders and archives for the dataset tests, hostile ones included.

Every attack is generated here, in the test run: nothing hostile is stored in the repo.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image

from torchyard.sample_data import write_digits


def digits_tree(root: Path, per_class: int = 5) -> Path:
    """A labeled folder of real images (scikit-learn digits): ``root/train/<0..9>/*.png``."""
    train, _ = write_digits(root, per_class=per_class, validation_fraction=0.2)
    return train


def small_tree(root: Path, classes: Iterable[str] = ("cat", "dog"), per_class: int = 3) -> Path:
    """A tiny labeled folder of random 16x16 PNGs."""
    rng = np.random.default_rng(0)
    for cls in classes:
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{cls}-{i}.png")
    return root


def count_images(root: Path) -> dict[str, int]:
    return {d.name: sum(1 for f in d.rglob("*") if f.is_file()) for d in sorted(root.iterdir()) if d.is_dir()}


def zip_tree(src: Path, out: Path, *, wrap: str | None = None) -> Path:
    """Zip every file and folder of ``src`` (optionally under one wrapping folder)."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src).as_posix()
            arc = f"{wrap}/{rel}" if wrap else rel
            zf.write(path, arc)
    return out


def tar_tree(src: Path, out: Path, *, mode: str = "w", wrap: str | None = None) -> Path:
    """Tar ``src`` (mode ``w``, ``w:gz``...), optionally under one wrapping folder."""
    with tarfile.open(out, mode) as tf:  # type: ignore[call-overload]
        tf.add(src, arcname=wrap or ".")
    return out


def _tar_member(tf: tarfile.TarFile, name: str, data: bytes = b"", **attrs: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    tf.addfile(info, io.BytesIO(data) if info.isreg() else None)


def png_bytes(size: int = 16, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def tar_with(out: Path, members: list[tuple[str, bytes, dict[str, object]]], *, mode: str = "w") -> Path:
    """A tar of hand-made members: ``(name, data, TarInfo attributes)``."""
    with tarfile.open(out, mode) as tf:  # type: ignore[call-overload]
        for name, data, attrs in members:
            _tar_member(tf, name, data, **attrs)
    return out


def zip_with(
    out: Path, members: list[tuple[str, bytes]], *, unix_modes: dict[str, int] | None = None
) -> Path:
    """A zip of hand-made members; ``unix_modes`` sets a member's mode (file type bits included)."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            if unix_modes and name in unix_modes:
                info.create_system = 3
                info.external_attr = unix_modes[name] << 16
            zf.writestr(info, data)
    return out


def labeled_members(
    extra: list[tuple[str, bytes, dict[str, object]]],
) -> list[tuple[str, bytes, dict[str, object]]]:
    """Two valid classes of images plus ``extra`` members (the attack)."""
    base: list[tuple[str, bytes, dict[str, object]]] = [
        (f"{cls}/{i}.png", png_bytes(seed=i), {}) for cls in ("a", "b") for i in range(2)
    ]
    return base + extra


def zip_bomb(out: Path, *, size: int, name: str = "a/zeros.png") -> Path:
    """A zip whose one member expands to ``size`` bytes of zeros (written in chunks)."""
    chunk = bytes(1024 * 1024)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("b/x.png", png_bytes())
        info = zipfile.ZipInfo(name)
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w", force_zip64=True) as dst:
            left = size
            while left > 0:
                dst.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
    return out


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def tar_bomb(out: Path, *, size: int, name: str = "a/zeros.png") -> Path:
    """A .tar.gz whose one member expands to ``size`` bytes of zeros."""
    with tarfile.open(out, "w:gz") as tf:
        info = tarfile.TarInfo(name)
        info.size = size
        tf.addfile(info, io.BufferedReader(_Zeros(size)))
    return out


def huge_png(path: Path, width: int = 30000, height: int = 30000) -> Path:
    """A valid 1-bit greyscale PNG of ``width`` x ``height`` zero pixels, compressed to ~100 KiB.

    The image data is deflated row block by row block, so building it never needs more
    than a few MiB of memory although it decodes to ``width * height`` pixels.
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (width + 7) // 8)  # filter byte 0 + packed 1-bit pixels
    comp = zlib.compressobj(9)
    parts = []
    block = row * 1000
    for start in range(0, height, 1000):
        rows = min(1000, height - start)
        parts.append(comp.compress(block if rows == 1000 else row * rows))
    parts.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")
    path.write_bytes(data)
    return path


def truncated_png(path: Path) -> Path:
    data = png_bytes(size=128, seed=3)
    path.write_bytes(data[: len(data) // 2])
    return path


def all_files(root: Path) -> set[str]:
    """Every path below ``root`` (files, folders, links), relative, for before/after checks."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def is_regular(path: Path) -> bool:
    return stat.S_ISREG(path.lstat().st_mode)
