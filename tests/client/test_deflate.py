"""The gzip stream that stores what does not compress (torchyard/contract/deflate.py): every
reader reads it whole, it is deterministic, and incompressible files are stored."""

from __future__ import annotations

import gzip
import io
import json
import random
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from torchyard.contract.deflate import (
    DEFAULT_LEVEL,
    MIN_SAMPLE_BYTES,
    GzipWriter,
    LevelChooser,
    stores_better,
)


def _files(root: Path) -> dict[str, bytes]:
    rng = random.Random(3)
    lines = "\n".join(json.dumps({"epoch": i, "loss": rng.random()}) for i in range(20000)).encode()
    files = {
        "weights.safetensors": rng.randbytes(1_000_000),  # does not deflate
        "log.jsonl": lines,  # deflates several times
        "config.json": b'{"architecture": "resnet18"}',  # too small to sample
        "empty.txt": b"",
        "more.safetensors": rng.randbytes(2_000),  # small: takes its suffix's level
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


def _pack(root: Path, names: list[str], dest: Path) -> None:
    levels = LevelChooser()
    with open(dest, "wb") as raw, GzipWriter(raw) as gz, tarfile.open(fileobj=gz, mode="w") as tar:  # type: ignore[call-overload]
        for name in names:
            path = root / name
            gz.set_level(levels.for_file(path, path.stat().st_size))
            tar.add(path, arcname=name)


def test_a_mixed_archive_reads_back_whole_with_every_reader_and_stores_the_weights(tmp_path: Path) -> None:
    files = _files(tmp_path)
    names = sorted(files)
    dest = tmp_path / "out.tar.gz"
    _pack(tmp_path, names, dest)

    expected = {n: files[n] for n in names}
    with tarfile.open(dest, "r:gz") as tar:  # random access (gzip.GzipFile)
        assert {m.name: tar.extractfile(m).read() for m in tar if m.isreg()} == expected  # type: ignore[union-attr]
    with tarfile.open(dest, "r|gz") as tar:  # streaming (tarfile's own zlib reader)
        got = {}
        for m in tar:
            got[m.name] = tar.extractfile(m).read()  # type: ignore[union-attr]
        assert got == expected
    raw_tar = gzip.decompress(dest.read_bytes())
    with tarfile.open(fileobj=io.BytesIO(raw_tar)) as tar:
        assert tar.getnames() == names
    if shutil.which("gzip"):
        subprocess.run(["gzip", "-t", str(dest)], check=True)

    # The random weights are stored (not smaller), the log deflated several times.
    size = dest.stat().st_size
    weights = len(files["weights.safetensors"]) + len(files["more.safetensors"])
    assert weights < size < weights + len(files["log.jsonl"]) // 3
    # Deterministic: the same files give the same bytes.
    again = tmp_path / "again.tar.gz"
    _pack(tmp_path, names, again)
    assert again.read_bytes() == dest.read_bytes()


def test_levels_per_file_and_per_suffix(tmp_path: Path) -> None:
    rng = random.Random(5)
    assert stores_better(rng.randbytes(100_000))
    assert not stores_better(b"epoch 1 loss 0.25\n" * 5000)
    assert not stores_better(b"")

    levels = LevelChooser(level=9)
    small = tmp_path / "a.onnx"
    small.write_bytes(rng.randbytes(MIN_SAMPLE_BYTES - 1))
    # Too small to tell, and no .onnx seen yet: the archive's level.
    assert levels.for_file(small, small.stat().st_size) == 9
    big = tmp_path / "b.onnx"
    big.write_bytes(rng.randbytes(300_000))
    assert levels.for_file(big, big.stat().st_size) == 0
    # Now the suffix is known to be stored.
    assert levels.for_file(small, small.stat().st_size) == 0
    text = tmp_path / "metrics.csv"
    text.write_text("epoch,loss\n" + "".join(f"{i},{i / 7:.4f}\n" for i in range(50000)))
    assert levels.for_file(text, text.stat().st_size) == 9
    assert LevelChooser().level == DEFAULT_LEVEL


@pytest.mark.parametrize("changes", [[0, 6, 0, 1], [6, 6, 6], [0]])
def test_level_changes_with_and_without_data_between_them(changes: list[int]) -> None:
    rng = random.Random(len(changes))
    out = io.BytesIO()
    chunks = []
    with GzipWriter(out, level=changes[0]) as gz:
        for i, level in enumerate(changes):
            gz.set_level(level)
            gz.set_level(level)  # twice: nothing written in between
            chunk = rng.randbytes(70_000) if i % 2 else b"text " * 20_000
            chunks.append(chunk)
            assert gz.write(chunk) == len(chunk)
            assert gz.write(b"") == 0
        assert gz.tell() == sum(len(c) for c in chunks)
    assert gzip.decompress(out.getvalue()) == b"".join(chunks)
