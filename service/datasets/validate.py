"""Validation of ImageDirectory datasets: class folders of decodable images.

Layout rules (docs/datasets.md): the data root holds one sub-folder per class, images inside
(nested folders inside a class are allowed, as torchvision's ImageFolder allows them).
One wrapping top-level folder around the class folders is allowed. Hidden entries and
``__MACOSX`` folders are ignored everywhere.

Every image is decoded with Pillow under a pixel cap, restricted to the supported
formats (so that a file named ``.jpg`` can never reach another of Pillow's parsers).
Pillow's own global decompression-bomb limit is left as it is: the cap is applied
here, from the image header, before any pixel is decoded.
"""

from __future__ import annotations

import logging
import os
import random
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from torchyard.contract.dataset_digest import (
    file_sha256,
    find_data_root,
    is_ignored_name,
    is_image_name,
    list_files,
    manifest_sha256,
)
from torchyard.contract.errors import InvalidDatasetError, NotLabeledDatasetError

logger = logging.getLogger(__name__)

#: Default pixel cap per image (width x height): 8192 x 8192.
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192

# Pillow format names of the supported extensions (camera MPO files open through JPEG).
_PILLOW_FORMATS = ("JPEG", "PNG", "BMP", "WEBP", "GIF", "TIFF")
_MAX_NAMED = 5


@dataclass(frozen=True)
class ValidatedDataset:
    """What validation found: the facts a dataset record stores."""

    data_root: Path
    classes: list[str]
    class_counts: dict[str, int]
    num_images: int
    size_bytes: int
    sha256: str
    files: list[str] = field(repr=False)
    decoded: int = 0


# Characters that reorder the text around them: a class named "dog\u202egnp.exe" shows as
# "dogexe.png". Refused in class names, with the other characters below.
_BIDI_CONTROLS = frozenset({0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)})
# Format characters that are part of how scripts are written (Persian, Indic scripts, emoji
# sequences) and reorder nothing: ZERO WIDTH NON-JOINER and ZERO WIDTH JOINER.
_ALLOWED_FORMAT = frozenset({0x200C, 0x200D})
_CATEGORY_KINDS = {
    "Cc": "a control character",
    "Cf": "a format character",
    "Cs": "a lone surrogate (the name is not valid UTF-8)",
    "Co": "a private-use character",
    "Cn": "an unassigned code point",
}


def _refused_kind(char: str) -> str | None:
    """Why a class name may not hold ``char`` (None: it may)."""
    code = ord(char)
    if code in _BIDI_CONTROLS:
        return "a bidirectional control character"
    if 0xFDD0 <= code <= 0xFDEF or code & 0xFFFE == 0xFFFE:
        return "a Unicode non-character"
    if code in _ALLOWED_FORMAT:
        return None
    return _CATEGORY_KINDS.get(unicodedata.category(char))


def check_class_name(name: str) -> None:
    """InvalidDatasetError naming the first character (as U+XXXX) that a class name may not
    hold: bidirectional controls, non-characters, control, format (but the zero-width
    joiners), surrogate, private-use and unassigned code points."""
    refused = [(c, kind) for c in name if (kind := _refused_kind(c)) is not None]
    if not refused:
        return
    char, kind = refused[0]
    shown = "".join(f"<U+{ord(c):04X}>" if _refused_kind(c) else c for c in name)
    raise InvalidDatasetError(f"class folder {shown!r} contains U+{ord(char):04X}, {kind}; rename the folder")


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(repr(i) for i in items[:_MAX_NAMED])
    more = len(items) - _MAX_NAMED
    return shown + (f" and {more} more" if more > 0 else "")


def _visible_entries(folder: Path) -> list[os.DirEntry[str]]:
    with os.scandir(folder) as it:
        return sorted((e for e in it if not is_ignored_name(e.name)), key=lambda e: e.name)


def check_image(path: Path, max_pixels: int) -> str | None:
    """Decode one image fully; return why it is refused, or None if it is fine."""
    try:
        with Image.open(path, formats=_PILLOW_FORMATS) as im:
            width, height = im.size
            if width * height > max_pixels:
                return f"{width}x{height} pixels, more than the limit of {max_pixels}"
            im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return f"larger than the limit of {max_pixels} pixels (decompression bomb)"
    except Image.UnidentifiedImageError:
        return "not a supported image"
    except Exception as e:  # Pillow raises many types (OSError, SyntaxError, ValueError...) on bad data
        return f"cannot be decoded ({type(e).__name__}: {e})"
    return None


def validate_image_directory(
    root: Path,
    *,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    sample: int | None = None,
    max_files: int | None = None,
    link_roots: Sequence[Path] | None = None,
    workers: int = 4,
) -> ValidatedDataset:
    """Check that ``root`` is a labeled image directory and describe it.

    ``sample`` decodes only that many images (at least one per class, the rest drawn
    deterministically); every file is still hashed. ``max_files`` caps the number of
    files. ``link_roots``: symbolic links are followed only when they resolve inside
    these resolved folders (None: links are refused).

    Raises NotLabeledDatasetError when there are no class folders or images lie at the
    top level, InvalidDatasetError for any other problem.
    """
    data_root = find_data_root(Path(root))
    class_names = _class_folders(data_root)
    files = list_files(data_root, link_roots=link_roots)
    counts = _count_class_images(files, class_names, max_files)
    to_decode = _choose_sample(files, class_names, sample)
    results = _inspect_files(data_root, files, to_decode, max_pixels, workers)
    _refuse_bad_images(files, results)
    sha = manifest_sha256((rel, digest) for rel, (digest, _, _) in zip(files, results, strict=True))
    size = sum(s for _, s, _ in results)
    logger.info(
        "validated dataset at %s: %d classes, %d images (%d decoded), %d bytes",
        data_root,
        len(class_names),
        len(files),
        len(to_decode),
        size,
    )
    return ValidatedDataset(
        data_root=data_root,
        classes=class_names,
        class_counts=counts,
        num_images=len(files),
        size_bytes=size,
        sha256=sha,
        files=files,
        decoded=len(to_decode),
    )


def _class_folders(data_root: Path) -> list[str]:
    """The sorted class folder names; refuses a top level that is not only class folders."""
    entries = _visible_entries(data_root)
    root_files = [e.name for e in entries if not e.is_dir()]
    root_images = [n for n in root_files if is_image_name(n)]
    class_names = sorted(e.name for e in entries if e.is_dir())
    if root_images:
        raise NotLabeledDatasetError(
            f"images lie at the top level of the dataset ({_names(root_images)}); "
            "put each image in a sub-folder named after its class"
        )
    if not class_names:
        raise NotLabeledDatasetError(
            "the dataset has no class folders; put each image in a sub-folder named after its class"
        )
    if root_files:
        raise InvalidDatasetError(f"the dataset holds files that are not images: {_names(root_files)}")
    for name in class_names:
        check_class_name(name)
    if len(class_names) < 2:
        raise InvalidDatasetError(
            f"the dataset has only one class ({class_names[0]!r}); at least 2 class folders are needed"
        )
    return class_names


def _count_class_images(files: list[str], class_names: list[str], max_files: int | None) -> dict[str, int]:
    """Images per class; refuses too many files, files that are not images and empty classes."""
    if max_files is not None and len(files) > max_files:
        raise InvalidDatasetError(f"the dataset holds {len(files)} files, more than the limit of {max_files}")
    not_images = [f for f in files if not is_image_name(f)]
    if not_images:
        raise InvalidDatasetError(
            f"the dataset holds files that are not images ({_names(not_images)}); "
            "supported: jpg, jpeg, png, bmp, webp, gif, tif, tiff"
        )
    counts = dict.fromkeys(class_names, 0)
    for rel in files:
        counts[rel.split("/", 1)[0]] += 1
    empty = [c for c, n in counts.items() if n == 0]
    if empty:
        raise InvalidDatasetError(f"these classes have no images: {_names(empty)}")
    return counts


def _inspect_files(
    data_root: Path, files: list[str], to_decode: set[str], max_pixels: int, workers: int
) -> list[tuple[str, int, str | None]]:
    """(sha256, size, refusal reason) of each file; only those in ``to_decode`` are decoded."""

    def inspect(rel: str) -> tuple[str, int, str | None]:
        path = data_root / rel
        reason = check_image(path, max_pixels) if rel in to_decode else None
        return file_sha256(path), path.stat().st_size, reason

    if workers > 1 and len(files) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(inspect, files))
    return [inspect(rel) for rel in files]


def _refuse_bad_images(files: list[str], results: list[tuple[str, int, str | None]]) -> None:
    bad = [(rel, reason) for rel, (_, _, reason) in zip(files, results, strict=True) if reason]
    if bad:
        shown = "; ".join(f"{rel!r}: {reason}" for rel, reason in bad[:_MAX_NAMED])
        more = f"; and {len(bad) - _MAX_NAMED} more" if len(bad) > _MAX_NAMED else ""
        raise InvalidDatasetError(
            f"{len(bad)} image(s) cannot be used: {shown}{more}",
            details={"files": [rel for rel, _ in bad[:100]]},
        )


def _choose_sample(files: list[str], classes: list[str], sample: int | None) -> set[str]:
    if sample is None or sample >= len(files):
        return set(files)
    chosen: set[str] = set()
    seen: set[str] = set()
    for rel in files:  # the first image of every class
        cls = rel.split("/", 1)[0]
        if cls not in seen:
            seen.add(cls)
            chosen.add(rel)
    rest = [f for f in files if f not in chosen]
    k = max(0, min(len(rest), sample - len(chosen)))
    chosen.update(random.Random(0).sample(rest, k))
    return chosen
