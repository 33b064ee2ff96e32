"""ImageDirectory validation and the dataset checksum, on real images and hostile ones."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from service.datasets.validate import find_data_root, validate_image_directory
from tests.support.dataset_files import (
    count_images,
    digits_tree,
    huge_png,
    png_bytes,
    small_tree,
    tar_tree,
    truncated_png,
)
from torchyard.contract.archive import extract_archive
from torchyard.contract.dataset_digest import dataset_sha256, list_files, manifest_sha256
from torchyard.contract.errors import InvalidDatasetError, NotLabeledDatasetError


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return digits_tree(tmp_path_factory.mktemp("digits"), per_class=5)


def test_real_digits(digits: Path) -> None:
    v = validate_image_directory(digits)
    assert v.data_root == digits
    assert v.classes == [str(i) for i in range(10)]
    assert v.class_counts == count_images(digits) == {str(i): 4 for i in range(10)}
    assert v.num_images == 40
    assert v.size_bytes == sum(f.stat().st_size for f in digits.rglob("*.png"))
    assert v.sha256 == dataset_sha256(digits)
    assert v.decoded == 40


def test_checksum_is_the_documented_manifest(digits: Path) -> None:
    lines = sorted(
        f"{p.relative_to(digits).as_posix()}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n"
        for p in digits.rglob("*.png")
    )
    assert validate_image_directory(digits).sha256 == hashlib.sha256("".join(lines).encode()).hexdigest()


def test_checksum_tracks_content_and_names(tmp_path: Path) -> None:
    root = small_tree(tmp_path / "d")
    first = dataset_sha256(root)
    (root / "cat" / "cat-0.png").rename(root / "cat" / "cat-9.png")
    renamed = dataset_sha256(root)
    (root / "cat" / "cat-9.png").write_bytes(png_bytes(seed=42))
    changed = dataset_sha256(root)
    assert len({first, renamed, changed}) == 3
    (root / ".DS_Store").write_bytes(b"junk")  # ignored files do not count
    assert dataset_sha256(root) == changed
    assert manifest_sha256([("b", "1" * 64), ("a", "2" * 64)]) == manifest_sha256(
        [("a", "2" * 64), ("b", "1" * 64)]
    )


def test_wrapping_folder_hidden_files_and_macosx_ignored(tmp_path: Path) -> None:
    root = tmp_path / "upload"
    small_tree(root / "pets")
    (root / "__MACOSX" / "pets").mkdir(parents=True)
    (root / "__MACOSX" / "pets" / "._cat-0.png").write_bytes(b"resource fork")
    (root / ".DS_Store").write_bytes(b"junk")
    (root / "pets" / "cat" / ".hidden.png").write_bytes(b"not even an image")
    (root / "pets" / ".ipynb_checkpoints").mkdir()
    v = validate_image_directory(root)
    assert v.data_root == root / "pets"
    assert v.classes == ["cat", "dog"]
    assert v.class_counts == {"cat": 3, "dog": 3}
    assert v.files == [f"{c}/{c}-{i}.png" for c in ("cat", "dog") for i in range(3)]


def test_single_class_folder_is_not_a_wrapper(tmp_path: Path) -> None:
    small_tree(tmp_path, classes=("cat",))
    assert find_data_root(tmp_path) == tmp_path
    with pytest.raises(InvalidDatasetError, match="only one class"):
        validate_image_directory(tmp_path)


def test_class_folders_on_disk_with_refused_characters(tmp_path: Path) -> None:
    """A folder registered in place is held to the same class names as an upload: a name
    that is not UTF-8 (kept by the file system as bytes) or holds a bidi override is refused."""
    small_tree(tmp_path / "rtl", classes=("cat", "dog\u202egnp.exe"), per_class=1)
    with pytest.raises(InvalidDatasetError) as refused:
        validate_image_directory(tmp_path / "rtl")
    assert str(refused.value) == (
        "class folder 'dog<U+202E>gnp.exe' contains U+202E, a bidirectional control character; "
        "rename the folder"
    )
    small_tree(tmp_path / "latin1", classes=("cat", "dog"), per_class=1)
    os.rename(tmp_path / "latin1" / "dog", os.fsencode(tmp_path / "latin1") + b"/caf\xe9")
    with pytest.raises(InvalidDatasetError, match=r"'caf<U\+DCE9>' contains U\+DCE9, a lone surrogate"):
        validate_image_directory(tmp_path / "latin1")


def test_nested_folders_inside_a_class(tmp_path: Path) -> None:
    small_tree(tmp_path / "cat" / "2019", classes=("x",))
    small_tree(tmp_path, classes=("dog",))
    v = validate_image_directory(tmp_path)
    assert v.class_counts == {"cat": 3, "dog": 3}


def test_every_supported_format_and_case(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, size=(20, 20, 3), dtype=np.uint8)
    img = Image.fromarray(pixels)
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for ext, fmt in [
            ("jpg", "JPEG"),
            ("JPEG", "JPEG"),
            ("png", "PNG"),
            ("BMP", "BMP"),
            ("webp", "WEBP"),
            ("gif", "GIF"),
            ("tif", "TIFF"),
            ("TIFF", "TIFF"),
        ]:
            img.save(tmp_path / cls / f"img-{ext}.{ext}", fmt)
    # A PNG with a .jpg name is still a supported image.
    (tmp_path / "a" / "png-named.jpg").write_bytes(png_bytes())
    v = validate_image_directory(tmp_path)
    assert v.class_counts == {"a": 9, "b": 8}


def test_images_at_the_root_are_not_labeled(tmp_path: Path) -> None:
    small_tree(tmp_path)
    (tmp_path / "stray.png").write_bytes(png_bytes())
    with pytest.raises(NotLabeledDatasetError, match=r"stray\.png"):
        validate_image_directory(tmp_path)


def test_no_class_folders_is_not_labeled(tmp_path: Path) -> None:
    with pytest.raises(NotLabeledDatasetError, match="no class folders"):
        validate_image_directory(tmp_path)
    (tmp_path / "one.png").write_bytes(png_bytes())
    (tmp_path / "two.png").write_bytes(png_bytes(seed=1))
    with pytest.raises(NotLabeledDatasetError):
        validate_image_directory(tmp_path)


def test_wrapped_images_without_classes_are_not_labeled(tmp_path: Path) -> None:
    (tmp_path / "wrap").mkdir()
    (tmp_path / "wrap" / "one.png").write_bytes(png_bytes())
    # One folder of images and nothing else: a single class.
    with pytest.raises(InvalidDatasetError, match="only one class"):
        validate_image_directory(tmp_path)


def test_empty_class_refused(tmp_path: Path) -> None:
    small_tree(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".keep").write_bytes(b"")
    with pytest.raises(InvalidDatasetError, match="no images: 'empty'"):
        validate_image_directory(tmp_path)


def test_non_image_file_refused(tmp_path: Path) -> None:
    small_tree(tmp_path)
    (tmp_path / "cat" / "notes.txt").write_text("hello")
    with pytest.raises(InvalidDatasetError, match=r"not images.*cat/notes\.txt"):
        validate_image_directory(tmp_path)
    (tmp_path / "cat" / "notes.txt").unlink()
    (tmp_path / "README.md").write_text("hello")
    with pytest.raises(InvalidDatasetError, match=r"README\.md"):
        validate_image_directory(tmp_path)


def test_text_renamed_jpg_refused(tmp_path: Path) -> None:
    small_tree(tmp_path)
    (tmp_path / "dog" / "fake.jpg").write_text("just some text, not a JPEG")
    with pytest.raises(InvalidDatasetError, match=r"dog/fake\.jpg") as err:
        validate_image_directory(tmp_path)
    assert err.value.details == {"files": ["dog/fake.jpg"]}


def test_other_pillow_formats_never_parsed(tmp_path: Path) -> None:
    """A file Pillow could open with another plugin (here an EPS header) is not an image here."""
    small_tree(tmp_path)
    (tmp_path / "dog" / "eps.jpg").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    with pytest.raises(InvalidDatasetError, match="not a supported image"):
        validate_image_directory(tmp_path)


def test_truncated_png_refused(tmp_path: Path) -> None:
    small_tree(tmp_path)
    truncated_png(tmp_path / "cat" / "cut.png")
    with pytest.raises(InvalidDatasetError, match=r"cat/cut\.png"):
        validate_image_directory(tmp_path)


def test_decompression_bomb_refused_without_decoding(tmp_path: Path) -> None:
    small_tree(tmp_path)
    bomb = huge_png(tmp_path / "cat" / "bomb.png")
    assert bomb.stat().st_size < 1024 * 1024
    pillow_limit = Image.MAX_IMAGE_PIXELS
    with pytest.raises(InvalidDatasetError, match=r"cat/bomb\.png.*(30000x30000|decompression bomb)"):
        validate_image_directory(tmp_path)
    assert pillow_limit == Image.MAX_IMAGE_PIXELS, "Pillow's global limit must be left alone"


def test_pixel_cap_is_configurable(tmp_path: Path) -> None:
    small_tree(tmp_path)  # 16x16 images
    with pytest.raises(InvalidDatasetError, match="16x16 pixels, more than the limit of 100"):
        validate_image_directory(tmp_path, max_pixels=100)
    assert validate_image_directory(tmp_path, max_pixels=256).num_images == 6


def test_bad_images_named_up_to_five(tmp_path: Path) -> None:
    small_tree(tmp_path)
    for i in range(7):
        (tmp_path / "cat" / f"bad-{i}.png").write_bytes(b"garbage")
    with pytest.raises(InvalidDatasetError) as err:
        validate_image_directory(tmp_path)
    msg = err.value.message
    assert msg.startswith("7 image(s) cannot be used")
    assert all(f"cat/bad-{i}.png" in msg for i in range(5))
    assert "bad-5" not in msg and "and 2 more" in msg


def test_sample_decodes_fewer_but_hashes_all(tmp_path: Path) -> None:
    small_tree(tmp_path, per_class=10)
    full = validate_image_directory(tmp_path)
    sampled = validate_image_directory(tmp_path, sample=4)
    assert sampled.decoded == 4 and full.decoded == 20
    assert sampled.sha256 == full.sha256 and sampled.class_counts == full.class_counts


def test_max_files(tmp_path: Path) -> None:
    small_tree(tmp_path)
    with pytest.raises(InvalidDatasetError, match="more than the limit of 5"):
        validate_image_directory(tmp_path, max_files=5)


def test_symlinks_refused_unless_inside_allowed_roots(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    data = small_tree(allowed / "data")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png_bytes(seed=5))
    (allowed / "pool").mkdir()
    (allowed / "pool" / "shared.png").write_bytes(png_bytes(seed=6))

    os.symlink(outside / "secret.png", data / "cat" / "secret.png")
    with pytest.raises(InvalidDatasetError, match="symbolic link"):
        validate_image_directory(data, link_roots=[allowed.resolve()])
    with pytest.raises(InvalidDatasetError, match="symbolic link"):
        validate_image_directory(data)
    (data / "cat" / "secret.png").unlink()

    os.symlink(allowed / "pool" / "shared.png", data / "cat" / "shared.png")
    with pytest.raises(InvalidDatasetError, match="symbolic link"):
        validate_image_directory(data)  # links refused when no roots are given
    v = validate_image_directory(data, link_roots=[allowed.resolve()])
    assert v.class_counts == {"cat": 4, "dog": 3}
    assert "cat/shared.png" in list_files(data, link_roots=[allowed.resolve()])


def test_link_cycle_refused(tmp_path: Path) -> None:
    small_tree(tmp_path)
    os.symlink(tmp_path / "cat", tmp_path / "cat" / "loop")
    with pytest.raises(InvalidDatasetError, match="twice"):
        validate_image_directory(tmp_path, link_roots=[tmp_path.resolve()])


def test_fifo_refused(tmp_path: Path) -> None:
    small_tree(tmp_path)
    os.mkfifo(tmp_path / "cat" / "pipe.png")
    with pytest.raises(InvalidDatasetError, match="not a regular file"):
        validate_image_directory(tmp_path)


def test_digest_survives_a_tar_round_trip(digits: Path, tmp_path: Path) -> None:
    """What the worker recomputes after download equals what the service recorded."""
    v = validate_image_directory(digits)
    archive = tar_tree(digits, tmp_path / "d.tar", wrap="wrapped")
    out = extract_archive(archive, tmp_path / "staging")
    assert dataset_sha256(out / "wrapped") == v.sha256
    shutil.rmtree(out)
