"""A node's cache of decoded training images: one memory-mapped file per dataset and size.

Decoding dominates a CPU input pipeline: a loader worker spends most of a sample's time
in PIL's JPEG decoder and resampling, and every epoch did it again. With the cache, each
training image is decoded once per node, resized to the *cache geometry* and written as
uint8 pixels into ``pixels.u8`` (``N x S x S x 3``, one row per sample, in the job's
sample order) beside ``labels.npy`` (``N`` int64 class indices) and ``meta.json``.
Later epochs read a row (a page-cache hit) and only crop and flip it.

Cache geometry (what changes in the augmentation). ``S = int(image_size / 0.875)``,
the size the validation transform resizes to (256 for 224 px): the image's shorter side
is resized to ``S`` (PIL bilinear, antialiased) and the centre ``S x S`` square is kept.
The training transforms (:func:`worker.trainer.data.cached_train_transform`) then run on
those pixels: ``RandomResizedCrop(image_size)`` (and the flip of the ``standard`` level)
picks its box inside the ``S x S`` square instead of inside the original photo, so the
parts of a non-square photo outside its centre square are never seen, and a crop's
source resolution is at most ``S`` pixels. Every epoch, the first included, trains on
this geometry: the first epoch decodes and resizes on the fly (the same
:func:`decode_resized`) while the cache is being written, later ones read the cache,
and the pixels are byte for byte the same, so a run resumed from a checkpoint (cache
present) gives the numbers of an uninterrupted one (cache written during it).
``TORCHYARD_IMAGE_CACHE=0`` (a node setting) restores the previous pipeline (crops of
the original photo, GPU decoding where available). Validation images are not cached:
they keep the model directory's evaluation transform exactly.

Writing. Local rank 0 of a job starts one writer process (this module run as a program,
without torch) at the start of training; it takes the cache's lock file without
waiting (another job or rank already writing it: nothing to do), writes into a
temporary folder, and renames it into place when complete: a half-written cache is
never read, and a writer killed mid-way leaves a temporary folder that the next writer
removes under the lock. The writer stops when its parent process is gone. Ranks never
wait for it: until the folder appears, they decode on the fly.

Bounds: at most ``TORCHYARD_IMAGE_CACHE_MAX_GB`` (default 64) and at most half the free
space of the cache's file system; a dataset that does not fit is not cached (a log line
says so) and trains on the same geometry decoded on the fly each epoch.

Where: ``TORCHYARD_IMAGE_CACHE_DIR`` when set, else ``<work dir>/image-cache`` beside the
agent's dataset cache (``<work dir>/datasets/<sha256>``); a dataset elsewhere (a run
started by hand) is not cached unless that variable names a folder. Entries are keyed by
the dataset's sha256 (a fingerprint of the files' names, sizes and times when it is not
known), the size, and the ordered ``(file, class)`` list: jobs on the same dataset and
size share one file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from torchyard.contract.errors import InvalidDatasetError
from torchyard.contract.files import locked

log = logging.getLogger(__name__)

ENV_SWITCH = "TORCHYARD_IMAGE_CACHE"
ENV_MAX_GB = "TORCHYARD_IMAGE_CACHE_MAX_GB"
ENV_DIR = "TORCHYARD_IMAGE_CACHE_DIR"
DEFAULT_MAX_GB = 64.0
# At most this share of the cache file system's free space.
FREE_SPACE_SHARE = 0.5
PIXELS_FILE = "pixels.u8"
LABELS_FILE = "labels.npy"
META_FILE = "meta.json"
FORMAT = 1
# The same ratio as the evaluation transform's resize (torchyard.modeldir.EVAL_CROP_RATIO).
_CROP_RATIO = 0.875
_PARENT_CHECK_EVERY = 64


def cache_wanted() -> bool:
    """``TORCHYARD_IMAGE_CACHE``: on unless ``0``/``false``/``off``/``no``."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_size(image_size: int) -> int:
    """The side of the cached square: the evaluation resize (256 for 224)."""
    return int(image_size / _CROP_RATIO)


def max_cache_bytes() -> int:
    raw = os.environ.get(ENV_MAX_GB, "").strip()
    gb = float(raw) if raw else DEFAULT_MAX_GB
    if gb < 0:
        raise ValueError(f"{ENV_MAX_GB} must not be negative")
    return int(gb * 1e9)


def decode_resized(path: str, size: int) -> np.ndarray:
    """An image file as ``size x size x 3`` uint8 pixels: decoded as RGB, its shorter side
    resized to ``size`` (PIL bilinear, antialiased when shrinking), the centre square kept.
    What the cache holds and what an uncached epoch computes."""
    try:
        with Image.open(path) as opened:
            img = opened.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise InvalidDatasetError(f"cannot read image {Path(path).name!r}: {exc}") from exc
    w, h = img.size
    if w <= h:
        new_w, new_h = size, max(size, int(size * h / w))
    else:
        new_w, new_h = max(size, int(size * w / h)), size
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    left = round((new_w - size) / 2.0)
    top = round((new_h - size) / 2.0)
    img = img.crop((left, top, left + size, top + size))
    return np.array(img, dtype=np.uint8)


@dataclass(frozen=True)
class CacheEntry:
    """One cached dataset at one size: ``folder`` once complete."""

    folder: Path
    size: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * self.size * self.size * 3

    @property
    def lock_file(self) -> Path:
        return self.folder.parent / f".{self.folder.name}.lock"

    def ready(self) -> bool:
        return (self.folder / META_FILE).is_file()

    def open_pixels(self) -> np.memmap:
        return np.memmap(self.folder / PIXELS_FILE, dtype=np.uint8, mode="r", shape=self.shape)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.count, self.size, self.size, 3)


def cache_root(train_dir: str, sha256: str | None) -> Path | None:
    """Where this node keeps decoded images (see the module's docstring), or None."""
    configured = os.environ.get(ENV_DIR, "").strip()
    if configured:
        return Path(configured)
    if sha256:
        path = Path(train_dir).absolute()
        for folder in (path, *path.parents):
            if folder.name == sha256 and folder.parent.name == "datasets":
                return folder.parent.parent / "image-cache"
    return None


def _fingerprint(samples: Sequence[tuple[str, int]]) -> str:
    digest = hashlib.sha256()
    for path, _ in samples:
        st = os.stat(path)
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cache_entry(
    root: Path, train_dir: str, sha256: str | None, samples: Sequence[tuple[str, int]], size: int
) -> CacheEntry:
    """The entry of these samples at this size under ``root``."""
    dataset = sha256 or _fingerprint(samples)
    digest = hashlib.sha256(f"{FORMAT}\n{dataset}\n{size}\n".encode())
    for path, target in samples:
        digest.update(f"{os.path.relpath(path, train_dir)}\0{target}\n".encode())
    return CacheEntry(root / f"{dataset[:16]}-{size}px-{digest.hexdigest()[:16]}", size, len(samples))


def fits(entry: CacheEntry) -> tuple[bool, str]:
    """Whether the entry may be written, and why not."""
    limit = max_cache_bytes()
    if entry.nbytes > limit:
        return False, f"{entry.nbytes / 1e9:.2f} GB is over {ENV_MAX_GB} ({limit / 1e9:.2f} GB)"
    entry.folder.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(entry.folder.parent).free
    if entry.nbytes > free * FREE_SPACE_SHARE:
        return False, f"{entry.nbytes / 1e9:.2f} GB is over half the free space of {entry.folder.parent}"
    return True, ""


def write_cache(
    entry: CacheEntry, samples: Sequence[tuple[str, int]], *, parent_pid: int | None = None
) -> bool:
    """Write the entry unless it exists or another process is writing it (then False at
    once). ``parent_pid``: stop (False) when that process is no longer this one's parent."""
    if entry.ready():
        return False
    entry.folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        with locked(entry.lock_file, blocking=False):
            if entry.ready():
                return False
            for stale in entry.folder.parent.glob(f".{entry.folder.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            return _write_locked(entry, samples, parent_pid)
    except BlockingIOError:
        return False


def _write_locked(entry: CacheEntry, samples: Sequence[tuple[str, int]], parent_pid: int | None) -> bool:
    ok, why = fits(entry)
    if not ok:
        log.info("image cache: not written: %s", why)
        return False
    started = time.monotonic()
    tmp = entry.folder.parent / f".{entry.folder.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        pixels = np.memmap(tmp / PIXELS_FILE, dtype=np.uint8, mode="w+", shape=entry.shape)
        for index, (path, _) in enumerate(samples):
            if parent_pid is not None and index % _PARENT_CHECK_EVERY == 0 and os.getppid() != parent_pid:
                log.info("image cache: the training process is gone: not written")
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            pixels[index] = decode_resized(path, entry.size)
        pixels.flush()
        del pixels
        np.save(tmp / LABELS_FILE, np.asarray([target for _, target in samples], dtype=np.int64))
        meta = {"format": FORMAT, "count": entry.count, "size": entry.size}
        (tmp / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
        for name in (PIXELS_FILE, LABELS_FILE, META_FILE):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        os.rename(tmp, entry.folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "image cache: %d images at %d px written in %.1f s (%.2f GB): %s",
        entry.count,
        entry.size,
        time.monotonic() - started,
        entry.nbytes / 1e9,
        entry.folder,
    )
    return True


def start_writer(entry: CacheEntry, samples: Sequence[tuple[str, int]]) -> None:
    """Write the entry in a process of its own (this module as a program, no torch), the
    samples passed on its standard input; returns at once."""
    import subprocess

    project = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (project, env.get("PYTHONPATH", "")) if p)
    process = subprocess.Popen(
        [sys.executable, "-m", "worker.trainer.image_cache"],
        stdin=subprocess.PIPE,
        env=env,
    )
    assert process.stdin is not None
    job = {
        "folder": str(entry.folder),
        "size": entry.size,
        "samples": [list(s) for s in samples],
        "parent": os.getpid(),
    }
    with process.stdin:
        process.stdin.write(json.dumps(job).encode())


def _die_with_parent() -> None:
    """Be killed with the training process (Linux ``PR_SET_PDEATHSIG``): a finished or
    killed rank leaves no writer behind; its temporary folder goes with the next writer."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the writer stops at its next check of its parent


def main() -> int:
    """The writer process: a JSON job on standard input (see :func:`start_writer`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    job = json.loads(sys.stdin.buffer.read())
    samples = [(str(path), int(target)) for path, target in job["samples"]]
    entry = CacheEntry(Path(job["folder"]), int(job["size"]), len(samples))
    try:
        write_cache(entry, samples, parent_pid=int(job["parent"]))
    except Exception as exc:  # the job trains on without the cache
        log.warning("image cache: not written: %s: %s", type(exc).__name__, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
