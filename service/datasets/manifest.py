"""The checks of a folder's manifest (:mod:`torchyard.contract.manifests`), for the folders
uploaded straight to the object store: the API never sees their bytes.

What is checked here is what the names and numbers show: the layout rules of
docs/datasets.md (class folders at the top, images only, safe names), the limits, and
that the checksum is the one of the files listed. What is not (that the archive holds
exactly these files, that the images decode) the node checks when it fetches the archive
(it recomputes the checksum), and the CLI before it uploads (it decodes every image).
"""

from __future__ import annotations

from service.datasets.validate import check_class_name
from torchyard.contract.archive import safe_member_parts
from torchyard.contract.dataset_digest import is_ignored_name, is_image_name, manifest_sha256
from torchyard.contract.errors import InvalidCodeError, InvalidDatasetError, NotLabeledDatasetError
from torchyard.contract.manifests import DatasetManifest, FolderManifest

_MAX_NAMED = 5


def _names(items: list[str]) -> str:
    shown = ", ".join(repr(i) for i in items[:_MAX_NAMED])
    more = len(items) - _MAX_NAMED
    return shown + (f" and {more} more" if more > 0 else "")


def _check_paths(manifest: FolderManifest, *, max_files: int, max_bytes: int, what: str) -> None:
    """Limits, canonical and safe relative paths, no ignored names. Raises InvalidDatasetError (the caller renames it for code)."""
    files = manifest.files
    if not files:
        raise InvalidDatasetError(f"the {what} holds no files")
    if len(files) > max_files:
        raise InvalidDatasetError(f"the {what} holds {len(files)} files, more than the limit of {max_files}")
    if manifest.num_files != len(files):
        raise InvalidDatasetError(f"the manifest says {manifest.num_files} files but lists {len(files)}")
    if manifest.size_bytes > max_bytes:
        raise InvalidDatasetError(
            f"the {what} holds {manifest.size_bytes} bytes, more than the limit of {max_bytes}"
        )
    for rel, digest in files.items():
        parts = safe_member_parts(rel)
        if "/".join(parts) != rel:
            raise InvalidDatasetError(f"path {rel!r} is not a plain relative path ('/'-separated, no '.')")
        if any(is_ignored_name(p) for p in parts):
            raise InvalidDatasetError(
                f"path {rel!r} has a hidden component; hidden entries are not part of a {what}"
            )
        if len(digest) != 64 or digest.strip("0123456789abcdef"):
            raise InvalidDatasetError(f"the sha256 of {rel!r} is not 64 lowercase hex digits")


def _check_sum(manifest: FolderManifest) -> None:
    listed = manifest_sha256(manifest.files.items())
    if listed != manifest.sha256:
        raise InvalidDatasetError(
            f"the manifest's checksum {manifest.sha256} is not the one of the files it lists ({listed})"
        )


def check_dataset_manifest(manifest: DatasetManifest, *, max_files: int, max_bytes: int) -> None:
    """422 (InvalidDatasetError, NotLabeledDatasetError) unless the manifest describes a
    dataset the layout rules accept."""
    _check_paths(manifest, max_files=max_files, max_bytes=max_bytes, what="dataset")
    top = sorted(rel for rel in manifest.files if "/" not in rel)
    top_images = [rel for rel in top if is_image_name(rel)]
    if top_images:
        raise NotLabeledDatasetError(
            f"images lie at the top level of the dataset ({_names(top_images)}); "
            "put each image in a sub-folder named after its class"
        )
    if top:
        raise InvalidDatasetError(f"the dataset holds files that are not images: {_names(top)}")
    not_images = sorted(rel for rel in manifest.files if not is_image_name(rel))
    if not_images:
        raise InvalidDatasetError(
            f"the dataset holds files that are not images ({_names(not_images)}); "
            "supported: jpg, jpeg, png, bmp, webp, gif, tif, tiff"
        )
    counts: dict[str, int] = {}
    for rel in manifest.files:
        cls = rel.split("/", 1)[0]
        counts[cls] = counts.get(cls, 0) + 1
    classes = sorted(counts)
    if not classes:
        raise NotLabeledDatasetError(
            "the dataset has no class folders; put each image in a sub-folder named after its class"
        )
    for name in classes:
        check_class_name(name)
    if len(classes) < 2:
        raise InvalidDatasetError(
            f"the dataset has only one class ({classes[0]!r}); at least 2 class folders are needed"
        )
    if manifest.classes != classes:
        raise InvalidDatasetError(
            f"the manifest names the classes {_names(manifest.classes)}, its files {_names(classes)}"
        )
    if manifest.class_counts != counts:
        raise InvalidDatasetError("the manifest's class counts are not those of the files it lists")
    _check_sum(manifest)


def check_code_manifest(manifest: FolderManifest, *, max_files: int, max_bytes: int) -> None:
    """422 (InvalidCodeError) unless the manifest describes a package the service accepts."""
    try:
        _check_paths(manifest, max_files=max_files, max_bytes=max_bytes, what="code package")
        _check_sum(manifest)
    except InvalidDatasetError as exc:
        raise InvalidCodeError(exc.message, details=exc.details) from None
