"""``torchyard code upload|list|show|delete``: code packages for script jobs."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchyard.commands.common import _client, _note, _print_json
from torchyard.terminal import (
    format_table,
    format_time,
    human_bytes,
)


def _code_upload(args: argparse.Namespace) -> int:
    from torchyard.apiclient.code import IGNORE_FILE, code_files

    folder = Path(args.folder)
    if folder.is_dir():
        files, skipped = code_files(folder)
        size = sum((folder / rel).stat().st_size for rel in files)
        # As the seed warns: the whole folder is sent. Say so before it is.
        _note(
            f"uploading the WHOLE folder {folder}: {len(files)} files ({human_bytes(size)}); keep secrets "
            f"and data out of it, or list them in {IGNORE_FILE} (gitignore syntax)"
        )
        for rel in skipped:
            _note(f"left out {rel}: not a regular file (links are not uploaded)")
        if not files:
            raise ValueError(f"{folder} has no files to upload")
    with _client(args) as client:
        package = client.upload_code(folder, args.name)
    if args.json:
        _print_json(package)
    else:
        print(package.id)
        _note(
            f"code {package.name!r}: {package.files} files ({human_bytes(package.size_bytes)}), sha256 {package.sha256[:12]}"
        )
    return 0


def _code_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = client.list_code(limit=args.limit).items
    if args.json:
        _print_json(items)
        return 0
    rows = [(c.id[:12], c.name, c.files, human_bytes(c.size_bytes), format_time(c.created_at)) for c in items]
    print(format_table(["ID", "NAME", "FILES", "SIZE", "CREATED"], rows))
    return 0


def _code_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        package = client.get_code(args.id)
    if args.json:
        _print_json(package)
        return 0
    print(f"id:       {package.id}")
    print(f"name:     {package.name}")
    print(f"files:    {package.files} ({human_bytes(package.size_bytes)})")
    print(f"sha256:   {package.sha256}")
    print(f"created:  {format_time(package.created_at)}")
    return 0


def _code_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_code(args.id)
    _note(f"deleted code package {args.id}")
    return 0


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``code`` and its verbs."""
    code = sub.add_parser("code", help="upload, list, show and delete code packages for script jobs")
    code_sub = code.add_subparsers(dest="code_command", required=True)
    code_up = code_sub.add_parser(
        "upload",
        parents=[common],
        help="upload a source folder (the whole folder, minus .torchyardignore) and print its id",
    )
    code_up.add_argument("folder", help="the folder (or a .zip/.tar.gz of it)")
    code_up.add_argument("--name", help="package name (default: the folder name)")
    code_up.set_defaults(handler=_code_upload)
    code_ls = code_sub.add_parser("list", parents=[common], help="list code packages, newest first")
    code_ls.add_argument("--limit", type=int, default=50)
    code_ls.set_defaults(handler=_code_list)
    code_show = code_sub.add_parser("show", parents=[common], help="show a code package")
    code_show.add_argument("id", help="code id, name or id prefix")
    code_show.set_defaults(handler=_code_show)
    code_rm = code_sub.add_parser("delete", parents=[common], help="delete a code package")
    code_rm.add_argument("id", metavar="CODE", help="the code package's id, name or id prefix")
    code_rm.set_defaults(handler=_code_delete)
