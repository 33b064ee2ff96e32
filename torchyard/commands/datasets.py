"""``torchyard datasets upload|list|show|delete``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torchyard.client import Client
from torchyard.commands.common import _DATASET_HELP, _client, _note, _print_json
from torchyard.contract.errors import ConflictError
from torchyard.terminal import (
    ProgressBar,
    format_table,
    format_time,
    human_bytes,
)


def _datasets_upload(args: argparse.Namespace) -> int:
    if len(args.source) == 2:  # `datasets upload NAME PATH`
        if args.name is not None:
            raise ValueError("give the dataset name once: as NAME or as --name")
        args.name, args.source = args.source[0], args.source[1:]
    if len(args.source) > 2 or bool(args.source) == (args.path is not None):
        raise ValueError(
            "give [NAME] PATH of a folder or archive to upload, or --path PATH to register shared storage"
        )
    args.source = args.source[0] if args.source else None
    with _client(args) as client:
        if args.path is not None:
            name = args.name or Path(args.path).name
            dataset = client.register_dataset(
                name, args.path, **({"sample": args.sample} if args.sample else {})
            )
        else:
            source = Path(args.source)
            if not source.exists():
                raise FileNotFoundError(f"no such file or folder: {source}")
            client.whoami()  # the service and the token, before a large folder is packed
            _check_name(client, args, source)
            bar = ProgressBar(f"uploading {source.name}")
            if source.is_dir() and not args.json:
                _note(f"packing {source} ...")
            try:
                dataset = client.upload_dataset(source, args.name, progress=bar)
            finally:
                bar.finish()
            if args.replace:
                _replace_older(client, dataset)
    if args.json:
        _print_json(dataset)
    else:
        print(dataset.id)
        _note(
            f"dataset {dataset.name!r}: {dataset.num_images} images in {len(dataset.classes)} classes "
            f"({human_bytes(dataset.size_bytes)}), sha256 {dataset.sha256[:12]}"
        )
    return 0


def _same_name(client: Client, name: str) -> list[Any]:
    return [d for d in client.iter_datasets() if d.name == name]


def _check_name(client: Client, args: argparse.Namespace, source: Path) -> None:
    """Say so before an upload adds a second dataset of a name (``--replace`` removes the
    older ones once the new one is stored)."""
    name = args.name or source.name.split(".")[0] or "dataset"
    existing = _same_name(client, name)
    if existing and not args.replace:
        ids = ", ".join(d.id for d in existing)
        _note(
            f"note: a dataset named {name!r} exists already ({ids}); this upload adds another one of "
            "that name (jobs and --train/--val take the newest). Use --replace to delete the older "
            "one(s) once this upload is stored."
        )


def _replace_older(client: Client, dataset: Any) -> None:
    for older in _same_name(client, dataset.name):
        if older.id == dataset.id:
            continue
        try:
            client.delete_dataset(older.id)
            _note(f"replaced: deleted the older dataset {older.id} of the name {dataset.name!r}")
        except ConflictError as exc:
            _note(f"kept the older dataset {older.id}: {exc.message}")


def _datasets_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = list(client.iter_datasets()) if args.all else client.list_datasets(limit=args.limit).items
    if args.json:
        _print_json(items)
        return 0
    rows = [
        (
            d.id,
            d.name,
            d.source or "-",
            len(d.classes),
            d.num_images,
            human_bytes(d.size_bytes),
            format_time(d.created_at),
        )
        for d in items
    ]
    print(format_table(["ID", "NAME", "SOURCE", "CLASSES", "IMAGES", "SIZE", "CREATED"], rows))
    return 0


def _datasets_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        dataset = client.get_dataset(args.id)
    if args.json:
        _print_json(dataset)
        return 0
    print(f"id:       {dataset.id}")
    print(f"name:     {dataset.name}")
    print(f"source:   {dataset.source}" + (f" ({dataset.path})" if dataset.path else ""))
    print(f"images:   {dataset.num_images} ({human_bytes(dataset.size_bytes)})")
    print(f"sha256:   {dataset.sha256}")
    print(f"created:  {format_time(dataset.created_at)}")
    print(f"classes:  {len(dataset.classes)}")
    print(format_table(["CLASS", "IMAGES"], [(c, dataset.class_counts.get(c, 0)) for c in dataset.classes]))
    return 0


def _datasets_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_dataset(args.id)
    if args.json:
        _print_json({"id": args.id, "deleted": True})
    else:
        _note(f"deleted dataset {args.id}")
    return 0


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``datasets`` and its verbs."""
    datasets = sub.add_parser("datasets", help="upload, list, show and delete datasets")
    ds_sub = datasets.add_subparsers(dest="datasets_command", required=True)
    up = ds_sub.add_parser(
        "upload",
        parents=[common],
        help="upload a folder of class sub-folders or an archive; --path registers shared storage",
    )
    up.add_argument(
        "source",
        nargs="*",
        metavar="[NAME] PATH",
        help="folder (packed to .tar.gz on the fly) or .zip/.tar/.tar.gz archive, optionally after its name",
    )
    up.add_argument(
        "--path", help="register this folder on the service's shared storage instead of uploading"
    )
    up.add_argument("--name", help="dataset name (default: the folder or file name)")
    up.add_argument("--sample", type=int, help="with --path: decode only this many images (large sets)")
    up.add_argument(
        "--replace",
        action="store_true",
        help="once the upload is stored, delete your older datasets of the same name "
        "(one a job still uses is kept)",
    )
    up.set_defaults(handler=_datasets_upload)
    ls = ds_sub.add_parser("list", parents=[common], help="list datasets, newest first")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--all", action="store_true", help="every page")
    ls.set_defaults(handler=_datasets_list)
    show = ds_sub.add_parser("show", parents=[common], help="one dataset with its per-class counts")
    show.add_argument("id", metavar="DATASET", help=_DATASET_HELP)
    show.set_defaults(handler=_datasets_show)
    delete = ds_sub.add_parser(
        "delete", parents=[common], help="delete a dataset (refused while a job uses it)"
    )
    delete.add_argument("id", metavar="DATASET", help=_DATASET_HELP)
    delete.set_defaults(handler=_datasets_delete)
