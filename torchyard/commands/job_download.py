"""``download``: a succeeded job's model directory, or a script job's outputs, checked
against its sha256 and unpacked."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from torchyard.commands.common import _JOB_HELP, _answer, _client, _note, _print_json
from torchyard.contract.archive import (
    MAX_OUTPUTS_FILES,
    MAX_OUTPUTS_UNCOMPRESSED_BYTES,
    ExtractionLimits,
    extract_archive,
)
from torchyard.contract.errors import InvalidDatasetError, TorchyardError
from torchyard.terminal import ProgressBar

# ``download --outputs -o NAME``: a NAME with one of these endings is the archive itself.
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")


def unpack_outputs(archive: Path, target: Path) -> Path:
    """Unpack a downloaded outputs archive into the new folder ``target``: regular files and
    folders only, every member inside it (no link, no absolute path or ``..``), within the
    outputs' limits; on any refusal nothing is left. A folder appears whole or not at all."""
    limits = ExtractionLimits(max_bytes=MAX_OUTPUTS_UNCOMPRESSED_BYTES, max_files=MAX_OUTPUTS_FILES)
    try:
        unpacked = extract_archive(archive, target.parent, limits)
    except InvalidDatasetError as exc:  # the archive's checks speak of datasets
        raise TorchyardError(f"the outputs archive was not unpacked: {exc.message}") from exc
    try:
        if target.is_dir():
            target.rmdir()  # empty: checked before the download
        os.replace(unpacked, target)
    except OSError:
        shutil.rmtree(unpacked, ignore_errors=True)
        raise
    mask = os.umask(0)
    os.umask(mask)
    target.chmod(0o777 & ~mask)  # made under a temporary name, private until now
    return target


def _download_outputs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.get_job(args.id)
        if args.path:  # one file of the outputs, as it is
            out = Path(args.output) if args.output else Path(Path(args.path).name)
            path = client.download_outputs(job.id, out, path=args.path)
            return _answer(args, {"job": job.id, "path": str(path), "sha256": job.outputs_sha256}, path)
        out = Path(args.output) if args.output else Path(f"outputs-{job.id}")
        if out.name.endswith(ARCHIVE_SUFFIXES):  # the archive as the service keeps it
            path = client.download_outputs(job.id, out)
            return _answer(args, {"job": job.id, "path": str(path), "sha256": job.outputs_sha256}, path)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"{out} already exists and is not empty")
        archive = client.download_outputs(job.id, out.with_name(out.name + ".tar.gz"))
    try:
        path = unpack_outputs(archive, out)
    finally:
        if not args.keep_archive:
            archive.unlink(missing_ok=True)
    return _answer(args, {"job": job.id, "path": str(path), "sha256": job.outputs_sha256}, path)


def _download(args: argparse.Namespace) -> int:
    if args.outputs or args.path:
        return _download_outputs(args)
    with _client(args) as client:
        job = client.get_job(args.id)  # the full id, whatever the user typed
        out = Path(args.output) if args.output else Path(f"model-{job.id}")
        bar = ProgressBar(f"model {job.id[:12]}")
        try:
            path = client.download_model(
                job.id,
                out,
                progress=bar,
                keep_archive=args.keep_archive,
                on_resume=lambda n: _note(f"resuming the download at byte {n}"),
            )
        finally:
            bar.finish()
        job = client.get_job(job.id)
    if args.json:
        _print_json({"job": job.id, "path": str(path), "sha256": job.model_sha256, "verified": True})
    else:
        print(path)
        _note(
            f"model directory verified (sha256 {job.model_sha256}); load it with torchyard.modeldir.load_model"
        )
    return 0


def add_download(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``download``."""
    download = sub.add_parser(
        "download",
        parents=[common],
        help="download, verify and unpack a succeeded job's model directory (or a script job's outputs)",
        description="Download a job's model directory, or with --outputs a script job's outputs "
        "folder: checked against its sha256 and unpacked into a new directory (-o). With --outputs, "
        "an -o ending in .tar.gz or .tgz is the archive itself, not unpacked; --path gets one file.",
    )
    download.add_argument("id", metavar="JOB", help=_JOB_HELP)
    download.add_argument(
        "-o",
        "--output",
        help="directory to create (default: ./model-<job id>, with --outputs ./outputs-<job id>); "
        "with --outputs, NAME.tar.gz or NAME.tgz keeps the archive as it is instead",
    )
    download.add_argument("--keep-archive", action="store_true", help="keep the .tar.gz beside the directory")
    download.add_argument(
        "--outputs", action="store_true", help="a script job's outputs folder instead of a model"
    )
    download.add_argument("--path", help="with --outputs: only this file of the outputs, as it is")
    download.set_defaults(handler=_download)
