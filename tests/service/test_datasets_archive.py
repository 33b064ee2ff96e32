"""Safe archive extraction: valid archives in every format, and every attack refused cleanly."""

from __future__ import annotations

import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from tests.support.dataset_files import (
    all_files,
    count_images,
    digits_tree,
    labeled_members,
    png_bytes,
    tar_bomb,
    tar_tree,
    tar_with,
    zip_bomb,
    zip_tree,
    zip_with,
)
from torchyard.contract import archive as archive_mod
from torchyard.contract.archive import ExtractionLimits, extract_archive, safe_member_parts
from torchyard.contract.errors import InvalidDatasetError

SMALL = ExtractionLimits(max_bytes=2 * 1024 * 1024, max_files=200)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return digits_tree(tmp_path_factory.mktemp("digits"), per_class=5)


@pytest.fixture
def work(tmp_path: Path) -> tuple[Path, Path]:
    """(folder holding the archives, staging folder)."""
    src = tmp_path / "in"
    src.mkdir()
    return src, tmp_path / "staging"


@pytest.mark.parametrize(
    ("fmt", "wrap"),
    [
        ("zip", None),
        ("zip", "digits"),
        ("tar", None),
        ("tar", "digits"),
        ("tar.gz", None),
        ("tgz", "digits"),
        ("tar.bz2", None),
        ("tar.xz", "digits"),
    ],
)
def test_extracts_every_format(digits: Path, work: tuple[Path, Path], fmt: str, wrap: str | None) -> None:
    src, staging = work
    archive = src / f"data.{fmt}"
    if fmt == "zip":
        zip_tree(digits, archive, wrap=wrap)
    else:
        mode = {"tar": "w", "tar.gz": "w:gz", "tgz": "w:gz", "tar.bz2": "w:bz2", "tar.xz": "w:xz"}[fmt]
        tar_tree(digits, archive, mode=mode, wrap=wrap)
    out = extract_archive(archive, staging, SMALL)
    assert out.parent == staging
    root = out / wrap if wrap else out
    assert count_images(root) == count_images(digits)
    for f in root.rglob("*"):
        assert not f.is_symlink()
        if f.is_file():
            assert f.read_bytes() == (digits / f.relative_to(root)).read_bytes()
            assert stat.S_IMODE(f.stat().st_mode) == 0o644


def test_format_detected_from_content_not_name(digits: Path, work: tuple[Path, Path]) -> None:
    src, staging = work
    archive = zip_tree(digits, src / "data.tar.gz")  # a zip with a misleading name
    assert count_images(extract_archive(archive, staging, SMALL)) == count_images(digits)


def test_not_an_archive(work: tuple[Path, Path]) -> None:
    src, staging = work
    bogus = src / "data.zip"
    bogus.write_text("hello, I am not an archive")
    with pytest.raises(InvalidDatasetError, match=r"not a \.zip"):
        extract_archive(bogus, staging, SMALL)
    assert not staging.exists() or not any(staging.iterdir())


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../evil.png", "'..'"),
        ("a/../../evil.png", "'..'"),
        ("/tmp/evil.png", "absolute"),
        ("C:/evil.png", "drive letter"),
        ("c:evil.png", "drive letter"),
        ("a\\..\\..\\evil.png", "backslash"),
        ("..\\evil.png", "backslash"),
        ("a/evil\n.png", "control"),
        ("", "empty"),
    ],
)
def test_member_names_refused(name: str, why: str) -> None:
    with pytest.raises(InvalidDatasetError, match=why):
        safe_member_parts(name)


def test_member_names_normalised() -> None:
    assert safe_member_parts("./a//b/./c.png") == ("a", "b", "c.png")
    assert safe_member_parts("./") == ()
    assert safe_member_parts("a..b/c..png") == ("a..b", "c..png")


def _assert_refused_cleanly(
    archive: Path, staging: Path, tmp_path: Path, match: str, limits: ExtractionLimits = SMALL
) -> None:
    before = all_files(tmp_path)
    with pytest.raises(InvalidDatasetError, match=match):
        extract_archive(archive, staging, limits)
    assert all_files(tmp_path) - before <= {"staging"}, "something was written outside the temp dir"
    assert not staging.exists() or list(staging.iterdir()) == [], "temp files remain"


@pytest.mark.parametrize("name", ["../evil.png", "/tmp/torchyard-evil.png", "a/../../evil.png"])
@pytest.mark.parametrize("fmt", ["zip", "tar", "tar.gz"])
def test_traversal_members_refused(work: tuple[Path, Path], tmp_path: Path, name: str, fmt: str) -> None:
    src, staging = work
    members = labeled_members([(name, png_bytes(), {})])
    archive = src / f"evil.{fmt}"
    if fmt == "zip":
        zip_with(archive, [(n, d) for n, d, _ in members])
    else:
        tar_with(archive, members, mode="w:gz" if fmt == "tar.gz" else "w")
    _assert_refused_cleanly(archive, staging, tmp_path, "'..'|absolute")
    assert not Path("/tmp/torchyard-evil.png").exists()
    assert not (tmp_path / "evil.png").exists() and not (tmp_path.parent / "evil.png").exists()


def test_zip_backslash_member_refused(work: tuple[Path, Path], tmp_path: Path) -> None:
    src, staging = work
    archive = zip_with(src / "evil.zip", [("a/1.png", png_bytes()), ("b\\..\\..\\evil.png", png_bytes())])
    _assert_refused_cleanly(archive, staging, tmp_path, "backslash")


def test_zip_drive_letter_refused(work: tuple[Path, Path], tmp_path: Path) -> None:
    src, staging = work
    archive = zip_with(src / "evil.zip", [("a/1.png", png_bytes()), ("C:/Windows/evil.png", png_bytes())])
    _assert_refused_cleanly(archive, staging, tmp_path, "drive letter")


@pytest.mark.parametrize("target", ["/etc/passwd", "../../../outside", "../b/0.png"])
def test_tar_symlink_refused(work: tuple[Path, Path], tmp_path: Path, target: str) -> None:
    src, staging = work
    archive = tar_with(
        src / "evil.tar",
        labeled_members([("a/link.png", b"", {"type": tarfile.SYMTYPE, "linkname": target})]),
    )
    _assert_refused_cleanly(archive, staging, tmp_path, "symbolic link")


@pytest.mark.parametrize("target", ["/etc/passwd", "../../outside.png"])
def test_tar_hardlink_refused(work: tuple[Path, Path], tmp_path: Path, target: str) -> None:
    src, staging = work
    archive = tar_with(
        src / "evil.tar.gz",
        labeled_members([("a/link.png", b"", {"type": tarfile.LNKTYPE, "linkname": target})]),
        mode="w:gz",
    )
    _assert_refused_cleanly(archive, staging, tmp_path, "hard link")


def test_symlink_then_write_through_it_refused(work: tuple[Path, Path], tmp_path: Path) -> None:
    """The classic two-step attack: a link to the outside, then a file written through it."""
    src, staging = work
    outside = tmp_path / "outside"
    outside.mkdir()
    archive = tar_with(
        src / "evil.tar",
        [
            ("a", b"", {"type": tarfile.SYMTYPE, "linkname": str(outside)}),
            ("a/pwned.png", png_bytes(), {}),
        ],
    )
    _assert_refused_cleanly(archive, staging, tmp_path, "symbolic link")
    assert list(outside.iterdir()) == []


def test_zip_symlink_refused(work: tuple[Path, Path], tmp_path: Path) -> None:
    src, staging = work
    archive = zip_with(
        src / "evil.zip",
        [("a/1.png", png_bytes()), ("b/link.png", b"/etc/passwd")],
        unix_modes={"b/link.png": stat.S_IFLNK | 0o777},
    )
    _assert_refused_cleanly(archive, staging, tmp_path, "symbolic link")


@pytest.mark.parametrize(
    ("kind", "match"),
    [(tarfile.CHRTYPE, "device"), (tarfile.BLKTYPE, "device"), (tarfile.FIFOTYPE, "fifo")],
)
def test_tar_device_and_fifo_refused(
    work: tuple[Path, Path], tmp_path: Path, kind: bytes, match: str
) -> None:
    src, staging = work
    archive = tar_with(
        src / "evil.tar",
        labeled_members([("a/null.png", b"", {"type": kind, "devmajor": 1, "devminor": 3})]),
    )
    _assert_refused_cleanly(archive, staging, tmp_path, match)


def test_zip_device_refused(work: tuple[Path, Path], tmp_path: Path) -> None:
    src, staging = work
    archive = zip_with(
        src / "evil.zip",
        [("a/1.png", png_bytes()), ("b/dev.png", b"")],
        unix_modes={"b/dev.png": stat.S_IFCHR | 0o666},
    )
    _assert_refused_cleanly(archive, staging, tmp_path, "device")


def _record_peak(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record how many bytes the temporary folder held when it was removed."""
    peaks: list[int] = []
    real_rmtree = shutil.rmtree

    def rmtree(path: str | Path, *args: object, **kwargs: object) -> None:
        peaks.append(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()))
        real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(archive_mod.shutil, "rmtree", rmtree)
    return peaks


def test_zip_bomb_refused_with_bounded_disk_use(work: tuple[Path, Path], tmp_path: Path) -> None:
    src, staging = work
    archive = zip_bomb(src / "bomb.zip", size=64 * 1024 * 1024)
    assert archive.stat().st_size < 1024 * 1024
    _assert_refused_cleanly(archive, staging, tmp_path, "more than")


def test_zip_bomb_counted_while_writing(
    work: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the central-directory shortcut, the bytes actually written are still capped."""
    src, staging = work
    archive = zip_bomb(src / "bomb.zip", size=64 * 1024 * 1024)
    monkeypatch.setattr(archive_mod, "_precheck_zip", lambda infos, limits: None)
    peaks = _record_peak(monkeypatch)
    _assert_refused_cleanly(archive, staging, tmp_path, "expands to more than")
    assert peaks and max(peaks) <= SMALL.max_bytes


def test_tar_bomb_refused_with_bounded_disk_use(
    work: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, staging = work
    archive = tar_bomb(src / "bomb.tar.gz", size=64 * 1024 * 1024)
    assert archive.stat().st_size < 1024 * 1024
    peaks = _record_peak(monkeypatch)
    _assert_refused_cleanly(archive, staging, tmp_path, "expands to more than")
    assert peaks and max(peaks) <= SMALL.max_bytes


@pytest.mark.parametrize("fmt", ["zip", "tar"])
def test_too_many_files_refused(work: tuple[Path, Path], tmp_path: Path, fmt: str) -> None:
    src, staging = work
    members: list[tuple[str, bytes, dict[str, object]]] = [
        (f"a/{i}.png", b"x", {}) for i in range(SMALL.max_files + 1)
    ]
    if fmt == "zip":
        archive = zip_with(src / "many.zip", [(n, d) for n, d, _ in members])
    else:
        archive = tar_with(src / "many.tar", members)
    _assert_refused_cleanly(archive, staging, tmp_path, "entries")


def test_oversized_pax_header_refused(work: tuple[Path, Path], tmp_path: Path) -> None:
    """tarfile reads a pax header in one piece: a huge one must not be loaded into memory."""
    src, staging = work
    archive = src / "pax.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("a/1.png")
        info.pax_headers = {"comment": "x" * (8 * 1024 * 1024)}
        tf.addfile(info, None)
    _assert_refused_cleanly(archive, staging, tmp_path, "oversized header")


def test_duplicate_member_refused(work: tuple[Path, Path], tmp_path: Path) -> None:
    src, staging = work
    archive = tar_with(src / "dup.tar", labeled_members([("a/0.png", png_bytes(seed=9), {})]))
    _assert_refused_cleanly(archive, staging, tmp_path, "more than once")


def test_truncated_and_corrupt_archives_refused(
    digits: Path, work: tuple[Path, Path], tmp_path: Path
) -> None:
    src, staging = work
    for fmt, mode in (("zip", None), ("tar.gz", "w:gz"), ("tar", "w")):
        full = src / f"full.{fmt}"
        if mode is None:
            zip_tree(digits, full)
        else:
            tar_tree(digits, full, mode=mode)
        data = full.read_bytes()
        cut = src / f"cut.{fmt}"
        cut.write_bytes(data[: len(data) // 2])
        _assert_refused_cleanly(cut, staging, tmp_path, r"cannot be read|not a \.zip|truncat|unexpected")


def test_dataset_tar_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    from service.datasets.tarstream import DatasetTar
    from torchyard.contract.dataset_digest import dataset_sha256, list_files

    root = tmp_path / "ds"
    long_name = "x" * 150 + ".png"
    for rel, seed in (("a/1.png", 1), (f"a/{long_name}", 2), ("b/été/ü.png", 3), ("b/2.png", 4)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(png_bytes(seed=seed))
    files = list_files(root)
    tar = DatasetTar(root, files)
    first = b"".join(tar)
    assert len(first) == tar.size
    assert b"".join(DatasetTar(root, list(reversed(files)))) == first
    (root / "a" / "1.png").touch()  # times and owners are not part of the bytes
    assert b"".join(DatasetTar(root, files)) == first
    archive = tmp_path / "ds.tar"
    archive.write_bytes(first)
    out = extract_archive(archive, tmp_path / "staging", SMALL)
    assert list_files(out) == files
    assert dataset_sha256(out) == dataset_sha256(root)


def test_dataset_tar_stops_when_a_file_shrinks(tmp_path: Path) -> None:
    from service.datasets.tarstream import DatasetTar

    root = tmp_path / "ds"
    (root / "a").mkdir(parents=True)
    (root / "a" / "1.png").write_bytes(png_bytes(size=64))
    tar = DatasetTar(root, ["a/1.png"])
    (root / "a" / "1.png").write_bytes(b"short")
    with pytest.raises(InvalidDatasetError, match="changed"):
        b"".join(tar)
