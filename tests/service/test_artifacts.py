"""Model archives: deterministic packing, and the checks on what a worker uploads or a client unpacks."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.report_helpers import write_fake_model_dir
from torchyard.contract.errors import InvalidModelDirectoryError
from torchyard.contract.model_archive import extract_model_archive, inspect_model_archive, pack_model_dir

LIMIT = 10 * 1024 * 1024


def test_packing_is_deterministic_and_checkable(tmp_path: Path) -> None:
    folder = write_fake_model_dir(tmp_path / "model-a")
    (folder / "notes.txt").write_text("not in the manifest, not packed")
    sha1, size1 = pack_model_dir(folder, tmp_path / "one.tar.gz")
    # The same files elsewhere, written later, pack to the same bytes.
    other = write_fake_model_dir(tmp_path / "elsewhere" / "model-b")
    sha2, size2 = pack_model_dir(other, tmp_path / "two.tar.gz")
    assert (sha1, size1) == (sha2, size2)
    assert (tmp_path / "one.tar.gz").read_bytes() == (tmp_path / "two.tar.gz").read_bytes()
    assert sha1 == hashlib.sha256((tmp_path / "one.tar.gz").read_bytes()).hexdigest()

    with tarfile.open(tmp_path / "one.tar.gz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [
        "model",
        "model/SHA256SUMS",
        "model/config.json",
        "model/metrics.json",
        "model/model.safetensors",
    ]
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" for m in members)

    files = inspect_model_archive(tmp_path / "one.tar.gz", max_unpacked_bytes=LIMIT)
    assert set(files) == {"SHA256SUMS", "config.json", "metrics.json", "model.safetensors"}
    assert (
        files["model.safetensors"].sha256
        == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    )

    dest = tmp_path / "unpacked"
    dest.mkdir()
    (dest / "stale").write_text("replaced")
    extract_model_archive(tmp_path / "one.tar.gz", dest, max_unpacked_bytes=LIMIT)
    assert sorted(p.name for p in dest.iterdir()) == sorted(files)
    assert (dest / "config.json").read_bytes() == (folder / "config.json").read_bytes()


def test_packing_refuses_a_directory_that_does_not_match_its_manifest(tmp_path: Path) -> None:
    folder = write_fake_model_dir(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(b"tampered")
    with pytest.raises(InvalidModelDirectoryError, match="checksum mismatch"):
        pack_model_dir(folder, tmp_path / "out.tar.gz")
    (folder / "SHA256SUMS").unlink()
    with pytest.raises(InvalidModelDirectoryError, match="manifest"):
        pack_model_dir(folder, tmp_path / "out.tar.gz")


def _manifest(files: dict[str, bytes]) -> bytes:
    return "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(files.items())).encode()


GOOD = {"config.json": b"{}", "model.safetensors": b"w" * 100, "metrics.json": b"{}"}


def _archive(path: Path, build: Callable[[tarfile.TarFile], None]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        build(tar)
    return path


def _add(tar: tarfile.TarFile, name: str, data: bytes, **attrs: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data))


def _good(tar: tarfile.TarFile, files: dict[str, bytes] | None = None, manifest: bytes | None = None) -> None:
    files = GOOD if files is None else files
    for name, data in files.items():
        _add(tar, f"model/{name}", data)
    _add(tar, "model/SHA256SUMS", _manifest(GOOD) if manifest is None else manifest)


def _link(tar: tarfile.TarFile) -> None:
    _good(tar)
    info = tarfile.TarInfo("model/link")
    info.type = tarfile.SYMTYPE
    info.linkname = "/etc/passwd"
    tar.addfile(info)


def _device(tar: tarfile.TarFile) -> None:
    _good(tar)
    info = tarfile.TarInfo("model/dev")
    info.type = tarfile.CHRTYPE
    tar.addfile(info)


def _hardlink(tar: tarfile.TarFile) -> None:
    _good(tar)
    info = tarfile.TarInfo("model/hard")
    info.type = tarfile.LNKTYPE
    info.linkname = "model/config.json"
    tar.addfile(info)


Builder = Callable[[tarfile.TarFile], None]


def _good_plus(name: str, data: bytes) -> Builder:
    def build(tar: tarfile.TarFile) -> None:
        _good(tar)
        _add(tar, name, data)

    return build


def _good_with(files: dict[str, bytes] | None = None, manifest: bytes | None = None) -> Builder:
    return lambda tar: _good(tar, files, manifest)


def _only(names: list[str]) -> Builder:
    def build(tar: tarfile.TarFile) -> None:
        for name in names:
            _add(tar, name, GOOD.get(name.removeprefix("model/"), b""))

    return build


BAD: dict[str, tuple[Builder, str]] = {
    "symlink": (_link, "not a regular file"),
    "device": (_device, "not a regular file"),
    "hard link": (_hardlink, "not a regular file"),
    "traversal": (_good_plus("model/../evil", b"x"), "not a plain file"),
    "absolute": (_good_plus("/model/evil", b"x"), "not a plain file"),
    "outside model/": (_good_plus("other/file", b"x"), "not a plain file"),
    "nested folder": (_good_plus("model/sub/file", b"x"), "not a plain file"),
    "hidden name": (_good_plus("model/.hidden", b"x"), "not a plain file"),
    "missing file": (
        _good_with({k: v for k, v in GOOD.items() if k != "metrics.json"}),
        "missing metrics.json",
    ),
    "corrupt file": (_good_with({**GOOD, "model.safetensors": b"x" * 100}), "checksum mismatch"),
    "unlisted file": (_good_with({**GOOD, "extra.bin": b"x"}), "does not list"),
    "no manifest": (_only([f"model/{n}" for n in GOOD]), "no model/SHA256SUMS"),
    "manifest lacks a required file": (
        _good_with(manifest=_manifest({"config.json": b"{}", "metrics.json": b"{}"})),
        "does not list model.safetensors",
    ),
    "malformed manifest": (_good_with(manifest=b"nonsense\n"), "malformed"),
    "duplicate member": (_good_plus("model/config.json", b"{}"), "twice"),
    "too many members": (_only([f"model/f{i}" for i in range(70)]), "more than 64"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsafe_or_inconsistent_archives_are_refused(tmp_path: Path, case: str) -> None:
    build, message = BAD[case]
    path = _archive(tmp_path / "bad.tar.gz", build)
    with pytest.raises(InvalidModelDirectoryError, match=message):
        inspect_model_archive(path, max_unpacked_bytes=LIMIT)
    dest = tmp_path / "out"
    with pytest.raises(InvalidModelDirectoryError):
        extract_model_archive(path, dest, max_unpacked_bytes=LIMIT)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.tar.gz"]  # nothing left behind
    assert not (tmp_path.parent / "evil").exists()


def test_decompression_bombs_and_garbage_are_refused(tmp_path: Path) -> None:
    big = {**GOOD, "model.safetensors": b"\0" * (4 * 1024 * 1024)}
    bomb = _archive(tmp_path / "bomb.tar.gz", _good_with(big, _manifest(big)))
    assert bomb.stat().st_size < 64 * 1024
    with pytest.raises(InvalidModelDirectoryError, match="unpacks to more than"):
        inspect_model_archive(bomb, max_unpacked_bytes=1024 * 1024)
    assert inspect_model_archive(bomb, max_unpacked_bytes=LIMIT)  # fine under a larger limit

    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"this is not gzip")
    with pytest.raises(InvalidModelDirectoryError, match="not a valid"):
        inspect_model_archive(garbage, max_unpacked_bytes=LIMIT)
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(bomb.read_bytes()[:2000])
    with pytest.raises(InvalidModelDirectoryError):
        inspect_model_archive(truncated, max_unpacked_bytes=LIMIT)
    plain_gz = tmp_path / "plain.tar.gz"
    plain_gz.write_bytes(gzip.compress(b"hello"))
    with pytest.raises(InvalidModelDirectoryError):
        inspect_model_archive(plain_gz, max_unpacked_bytes=LIMIT)
