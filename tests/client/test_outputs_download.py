"""``torchyard download JOB --outputs``: the outputs archive unpacked into the directory
``-o`` names (safely: regular files and folders inside it only), or kept as it is for an
``-o`` ending in .tar.gz or .tgz. The service's side is the client's ``download_outputs``
(checked against the sha256; tests/e2e/test_script_jobs.py), here a stand-in."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from torchyard.cli import main
from torchyard.client import Client, Job

JOB = Job(id="a" * 32, name="script", status="succeeded", type="script", outputs_sha256="0" * 64)
OPTIONS = ["--url", "http://127.0.0.1:9", "--token", "t"]


def _archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, b""


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The archive the stand-in service sends (``served["archive"]``, replaceable)."""
    served = {
        "archive": _archive(
            tmp_path / "served.tar.gz",
            [_file("model.pt", b"weights"), _file("logs/rank-0.log", b"log\n"), _file("sub/x.json", b"{}")],
        )
    }

    def download_outputs(self: Client, job_id: str, dest: str | Path, *, path: str | None = None) -> Path:
        assert job_id == JOB.id and path is None
        shutil.copyfile(served["archive"], dest)
        return Path(dest)

    monkeypatch.setattr(Client, "get_job", lambda self, ref: JOB)
    monkeypatch.setattr(Client, "download_outputs", download_outputs)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return served


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*argv, *OPTIONS])
    out, err = capsys.readouterr()
    return code, out, err


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_o_names_a_directory_to_create_and_unpack_into(
    served: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = {"logs/rank-0.log": b"log\n", "model.pt": b"weights", "sub/x.json": b"{}"}
    code, out, err = _run(capsys, "download", JOB.id, "--outputs", "-o", "out")
    assert code == 0, err
    assert out == "out\n"
    assert _tree(Path("out")) == expected
    assert sorted(p.name for p in Path().iterdir()) == ["out"]  # the archive is not kept
    # By default: ./outputs-<job id>; --keep-archive keeps the .tar.gz beside it.
    code, out, err = _run(capsys, "download", JOB.id, "--outputs", "--keep-archive")
    assert code == 0, err
    assert out == f"outputs-{JOB.id}\n"
    assert _tree(Path(f"outputs-{JOB.id}")) == expected
    assert Path(f"outputs-{JOB.id}.tar.gz").read_bytes() == served["archive"].read_bytes()
    # A directory that is there and not empty is refused before anything is downloaded.
    code, _, err = _run(capsys, "download", JOB.id, "--outputs", "-o", "out")
    assert code == 1 and "out already exists and is not empty" in err
    # An empty one is filled.
    Path("empty").mkdir()
    assert _run(capsys, "download", JOB.id, "--outputs", "-o", "empty")[0] == 0
    assert _tree(Path("empty")) == expected


@pytest.mark.parametrize("name", ["raw.tar.gz", "raw.tgz"])
def test_o_ending_in_tar_gz_keeps_the_archive(
    served: dict[str, Path], capsys: pytest.CaptureFixture[str], name: str
) -> None:
    code, out, err = _run(capsys, "download", JOB.id, "--outputs", "-o", name)
    assert code == 0, err
    assert out == f"{name}\n"
    assert Path(name).read_bytes() == served["archive"].read_bytes()


@pytest.mark.parametrize(
    ("members", "words"),
    [
        ([_file("ok.txt", b"1"), _link("evil", "/etc/passwd")], "symbolic link"),
        ([_file("ok.txt", b"1"), _file("../escaped.txt", b"2")], "'..'"),
        ([_file("/abs.txt", b"2")], "absolute"),
    ],
)
def test_an_unsafe_archive_is_not_unpacked(
    served: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    members: list[tuple[tarfile.TarInfo, bytes]],
    words: str,
) -> None:
    served["archive"] = _archive(tmp_path / "unsafe.tar.gz", members)
    code, _, err = _run(capsys, "download", JOB.id, "--outputs", "-o", "out")
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: TorchyardError: the outputs archive was not unpacked: "), err
    assert words in line
    assert list(Path().iterdir()) == []  # no folder, no archive, nothing half-written
    assert not (tmp_path / "escaped.txt").exists()
