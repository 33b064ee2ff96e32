"""A node's cache of decoded images: one memory-mapped file per dataset and geometry.

Decoding dominates a CPU input pipeline: a loader worker spends most of a sample's time
in PIL's JPEG decoder and resampling, and every epoch did it again. With the cache, each
image is decoded once per node, resized to the entry's geometry and written as uint8
pixels into ``pixels.u8`` (``N x side x side x 3``, one row per sample, in the job's
sample order) beside ``labels.npy`` (``N`` int64 class indices) and ``meta.json``.
Later epochs read a row (a page-cache hit).

Training geometry. ``S = int(image_size / 0.875)``, the size the validation transform
resizes to (256 for 224 px): the image's shorter side is resized to ``S`` (PIL bilinear,
antialiased) and the centre ``S x S`` square is kept. The training crops
(:class:`worker.trainer.data.CachedTrainSet`, :func:`worker.trainer.data.crop_batch`:
torchvision's ``RandomResizedCrop`` rule and the flip of the ``standard`` level, made a
batch at a time on the GPU, or image by image by the loader workers on a CPU node) pick their box inside the ``S x S`` square
instead of inside the original photo, so the parts of a non-square photo outside its
centre square are never seen, and a crop's source resolution is at most ``S`` pixels.
Every epoch, the first included, trains on this geometry: the first epoch decodes and
resizes on the fly (the same :func:`decode_resized`) while the cache is being written,
later ones read the cache, and the pixels are byte for byte the same, so a run resumed
from a checkpoint (cache present) gives the numbers of an uninterrupted one (cache
written during it). ``TORCHYARD_IMAGE_CACHE=0`` (a node setting) restores the previous
pipeline (crops of the original photo, GPU decoding where available).

Validation geometry. The same resize, then the centre ``image_size`` square (``crop``):
byte for byte the pixels of the evaluation transform (``torchyard.modeldir.eval_geometry``),
so a job's metrics are those of an uncached run.

Writing. Local rank 0 of a job starts one writer process (this module run as a program,
without torch) at the start of training, which writes the job's missing entries one
after the other; for each it takes the entry's lock file without waiting (another job
or rank already writing it: on to the next), writes into a temporary folder, and
renames it into place when complete: a half-written cache is never read, and a writer
killed mid-way leaves a temporary folder that the next writer removes under the lock.
The writer stops when its parent process is gone. Ranks never wait for it: until the
folder appears, they decode on the fly.

Bounds: all entries together at most ``TORCHYARD_IMAGE_CACHE_MAX_GB`` (default 64), a new
one at most half the free space of the cache's file system. Before writing, the writer
evicts the least recently used entries that no running job uses (:func:`make_room`).
Each training process holds a shared ``flock`` on the ``.<entry>.use`` file of every
entry it reads, from before it looks for the entry until it ends, and sets the file's
time when it starts (:func:`mark_in_use`): that time orders the evictions, and an entry
whose use file is locked is never removed. An entry that does not fit is not written (a
log line says so) and its job decodes the same pixels on the fly each epoch.

Where: ``TORCHYARD_IMAGE_CACHE_DIR`` when set, else ``<work dir>/image-cache`` beside the
agent's dataset cache (``<work dir>/datasets/<sha256>``); a dataset elsewhere (a run
started by hand) is not cached unless that variable names a folder. Entries are keyed by
the dataset's sha256 (a fingerprint of the files' names, sizes and times when it is not
known), the size (and crop), and the ordered ``(file, class)`` list: jobs on the same
dataset and size share one file.
"""

from __future__ import annotations

import fcntl
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
from typing import BinaryIO

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


def decode_resized(path: str, size: int, crop: int | None = None) -> np.ndarray:
    """An image file as ``crop x crop x 3`` uint8 pixels (``crop`` defaults to ``size``):
    decoded as RGB, its shorter side resized to ``size`` (PIL bilinear, antialiased when
    shrinking), the centre square of side ``crop`` kept. What the cache holds and what an
    uncached epoch computes; with ``crop=image_size`` and ``size=cache_size(image_size)``,
    the pixels of the evaluation transform (``torchyard.modeldir.eval_geometry``)."""
    side = size if crop is None else crop
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
    left = round((new_w - side) / 2.0)
    top = round((new_h - side) / 2.0)
    img = img.crop((left, top, left + side, top + side))
    return np.array(img, dtype=np.uint8)


@dataclass(frozen=True)
class CacheEntry:
    """One cached dataset at one size: ``folder`` once complete. ``crop``: the side of the
    centre square kept after resizing the shorter side to ``size`` (the evaluation
    transform's pixels); ``None`` keeps the whole ``size`` square (the training geometry)."""

    folder: Path
    size: int
    count: int
    crop: int | None = None

    @property
    def side(self) -> int:
        return self.size if self.crop is None else self.crop

    @property
    def nbytes(self) -> int:
        return self.count * self.side * self.side * 3

    @property
    def lock_file(self) -> Path:
        return self.folder.parent / f".{self.folder.name}.lock"

    @property
    def use_file(self) -> Path:
        """Held with a shared ``flock`` by every process training on the entry, its
        modification time the entry's last use: see :func:`mark_in_use`."""
        return self.folder.parent / f".{self.folder.name}.use"

    def ready(self) -> bool:
        return (self.folder / META_FILE).is_file()

    def open_pixels(self) -> np.memmap:
        return np.memmap(self.folder / PIXELS_FILE, dtype=np.uint8, mode="r", shape=self.shape)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.count, self.side, self.side, 3)


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
    root: Path,
    data_dir: str,
    sha256: str | None,
    samples: Sequence[tuple[str, int]],
    size: int,
    *,
    crop: int | None = None,
) -> CacheEntry:
    """The entry of these samples at this size (and centre crop) under ``root``."""
    dataset = sha256 or _fingerprint(samples)
    digest = hashlib.sha256(f"{FORMAT}\n{dataset}\n{size}\n".encode())
    if crop is not None:
        digest.update(f"crop {crop}\n".encode())
    for path, target in samples:
        digest.update(f"{os.path.relpath(path, data_dir)}\0{target}\n".encode())
    geometry = f"{size}px" if crop is None else f"{size}to{crop}px"
    return CacheEntry(root / f"{dataset[:16]}-{geometry}-{digest.hexdigest()[:16]}", size, len(samples), crop)


def fits(entry: CacheEntry) -> tuple[bool, str]:
    """Whether the entry may be written, perhaps after evicting unused entries (see
    :func:`make_room`), and why not."""
    limit = max_cache_bytes()
    if entry.nbytes > limit:
        return False, f"{entry.nbytes / 1e9:.2f} GB is over {ENV_MAX_GB} ({limit / 1e9:.2f} GB)"
    entry.folder.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(entry.folder.parent).free
    evictable = sum(nbytes for _, _, nbytes in _complete_entries(entry.folder.parent, entry.folder))
    if entry.nbytes > (free + evictable) * FREE_SPACE_SHARE:
        return False, f"{entry.nbytes / 1e9:.2f} GB is over half the free space of {entry.folder.parent}"
    return True, ""


# The use marks this process holds (see mark_in_use), by use file.
_IN_USE: dict[Path, BinaryIO] = {}


def mark_in_use(entry: CacheEntry) -> None:
    """Mark the entry as used by this process until it ends (or :func:`release`): a shared
    ``flock`` on its use file, which no eviction takes from it, and the file's time set to
    now (the last use, which orders evictions). Taken before the entry is looked for, so
    an entry that is there, or that this job's writer puts there, stays while the job runs."""
    path = entry.use_file
    if path not in _IN_USE:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+b")  # noqa: SIM115 - held until the process ends
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH)  # waits only for an eviction under way
        except BaseException:
            handle.close()
            raise
        _IN_USE[path] = handle
    os.utime(path)


def release(entry: CacheEntry) -> None:
    """Drop this process's use mark of the entry (it becomes evictable)."""
    handle = _IN_USE.pop(entry.use_file, None)
    if handle is not None:
        handle.close()


def _entry_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _complete_entries(root: Path, skip: Path | None = None) -> list[tuple[float, Path, int]]:
    """``(last use, folder, bytes)`` of the complete entries under ``root``, oldest use first."""
    found = []
    for folder in root.iterdir() if root.is_dir() else ():
        if folder.name.startswith(".") or folder == skip or not (folder / META_FILE).is_file():
            continue
        try:
            use_file = root / f".{folder.name}.use"
            mark = use_file if use_file.exists() else folder / META_FILE
            found.append((mark.stat().st_mtime, folder, _entry_bytes(folder)))
        except OSError:  # removed meanwhile
            continue
    return sorted(found, key=lambda item: (item[0], item[1].name))


def _evict(folder: Path) -> bool:
    """Remove an entry unless a process holds its use mark (then False)."""
    use_file = folder.parent / f".{folder.name}.use"
    with open(use_file, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        # Out of its name first, under the lock: a job marking it now finds it gone.
        doomed = folder.parent / f".{folder.name}.evicted-{os.getpid()}"
        try:
            os.rename(folder, doomed)
        except FileNotFoundError:
            return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def make_room(entry: CacheEntry) -> tuple[bool, str]:
    """Evict the least recently used entries that no running job uses until ``entry`` fits
    in ``TORCHYARD_IMAGE_CACHE_MAX_GB`` with the others and in half the free space; whether
    it fits now, and why not. Entries in use are never removed."""
    ok, why = fits(entry)
    if not ok:
        return ok, why
    root = entry.folder.parent
    limit = max_cache_bytes()
    with locked(root / ".evict.lock"):
        entries = _complete_entries(root, entry.folder)
        used = sum(nbytes for _, _, nbytes in entries)
        free = shutil.disk_usage(root).free
        for _, folder, nbytes in entries:
            if used + entry.nbytes <= limit and entry.nbytes <= free * FREE_SPACE_SHARE:
                break
            if _evict(folder):
                log.info("image cache: evicted %s (%.2f GB, least recently used)", folder.name, nbytes / 1e9)
                used -= nbytes
                free = shutil.disk_usage(root).free
    if used + entry.nbytes > limit:
        return False, (
            f"{(used + entry.nbytes) / 1e9:.2f} GB with the entries in use is over {ENV_MAX_GB} "
            f"({limit / 1e9:.2f} GB)"
        )
    if entry.nbytes > free * FREE_SPACE_SHARE:
        return False, f"{entry.nbytes / 1e9:.2f} GB is over half the free space of {root}"
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
    ok, why = make_room(entry)
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
            pixels[index] = decode_resized(path, entry.size, entry.crop)
        pixels.flush()
        del pixels
        np.save(tmp / LABELS_FILE, np.asarray([target for _, target in samples], dtype=np.int64))
        meta = {"format": FORMAT, "count": entry.count, "size": entry.size, "crop": entry.crop}
        (tmp / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
        for name in (PIXELS_FILE, LABELS_FILE, META_FILE):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        os.rename(tmp, entry.folder)
        entry.use_file.touch()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "image cache: %d images at %d px written in %.1f s (%.2f GB): %s",
        entry.count,
        entry.side,
        time.monotonic() - started,
        entry.nbytes / 1e9,
        entry.folder,
    )
    return True


def start_writer(entries: Sequence[tuple[CacheEntry, Sequence[tuple[str, int]]]]) -> None:
    """Write the entries, one after the other, in a process of its own (this module as a
    program, no torch), their samples passed on its standard input; returns at once."""
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
        "entries": [
            {
                "folder": str(entry.folder),
                "size": entry.size,
                "crop": entry.crop,
                "samples": [list(s) for s in samples],
            }
            for entry, samples in entries
        ],
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
    for item in job["entries"]:
        samples = [(str(path), int(target)) for path, target in item["samples"]]
        crop = item.get("crop")
        entry = CacheEntry(
            Path(item["folder"]), int(item["size"]), len(samples), None if crop is None else int(crop)
        )
        try:
            write_cache(entry, samples, parent_pid=int(job["parent"]))
        except Exception as exc:  # the job trains on without the cache
            log.warning("image cache: not written: %s: %s", type(exc).__name__, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
