"""``torchyard weights upload|list|show|delete``: pretrained weights for fine-tuning
(docs/fine-tuning.md)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from torchyard.commands.common import _client, _note, _print_json
from torchyard.terminal import format_table, format_time, human_bytes


def check_state_dict(architecture: str, file: Path) -> str | None:
    """Why ``file`` is not a state dict of ``architecture`` (torchvision's default number of
    classes), or None when it fits; None as well where torch is not installed (the node
    checks it then, when a job loads it)."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("torchvision") is None:
        return None
    import torch
    import torchvision

    if architecture not in torchvision.models.list_models(module=torchvision.models):
        return None  # the service names the architectures it knows
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a foreign file fails in many ways inside torch.load
        return f"{file} is not a torch state dict: {type(exc).__name__}: {exc}"
    if not isinstance(state, dict):
        return f"{file} holds a {type(state).__name__}, not a state dict"
    model = torchvision.models.get_model(architecture, weights=None)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(getattr(v, "shape", ())) for k, v in state.items()}
    parts = _differences(expected, got)
    return f"{file} does not fit {architecture}: " + ", ".join(parts) if parts else None


def _differences(expected: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> list[str]:
    """A state dict's missing and unexpected keys and differing shapes, in words."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s) (first {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} unexpected key(s) (first {extra[0]})")
    if wrong:
        first = wrong[0]
        parts.append(f"{len(wrong)} shape(s) differ (first {first}: {got[first]} for {expected[first]})")
    return parts


def _weights_upload(args: argparse.Namespace) -> int:
    file = Path(args.file)
    if not file.is_file():
        raise FileNotFoundError(f"no such file: {file}")
    if not args.no_check and (problem := check_state_dict(args.architecture, file)) is not None:
        raise ValueError(problem)
    with _client(args) as client:
        row = client.upload_weights(args.architecture, file)
    if args.json:
        _print_json(row)
    else:
        print(row.id)
        _note(
            f"weights for {row.architecture}: {row.filename} ({human_bytes(row.size_bytes)}), sha256 {row.sha256}"
        )
    return 0


def _weights_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = client.list_weights(args.architecture)
    if args.json:
        _print_json(items)
        return 0
    rows = [
        (
            w.id[:12],
            w.architecture,
            w.filename,
            human_bytes(w.size_bytes),
            w.sha256[:12],
            format_time(w.created_at),
        )
        for w in items
    ]
    print(format_table(["ID", "ARCHITECTURE", "FILE", "SIZE", "SHA256", "UPLOADED"], rows))
    return 0


def _weights_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        row = client.get_weights(args.id)
    if args.json:
        _print_json(row)
        return 0
    print(f"id:            {row.id}")
    print(f"architecture:  {row.architecture}")
    print(f"file:          {row.filename} ({human_bytes(row.size_bytes)})")
    print(f"sha256:        {row.sha256}")
    print(f"uploaded:      {format_time(row.created_at)} by {row.uploaded_by}")
    return 0


def _weights_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_weights(args.id)
    _note(f"deleted weights {args.id}")
    return 0


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``weights`` and its verbs."""
    weights = sub.add_parser(
        "weights", help="upload, list, show and delete pretrained weights for fine-tuning (pretrained: true)"
    )
    verbs = weights.add_subparsers(dest="weights_command", required=True)
    up = verbs.add_parser(
        "upload",
        parents=[common],
        help="upload a state dict (torch.save(model.state_dict(), FILE), or torchvision's weights file) "
        "as ARCH's pretrained weights and print its id",
    )
    up.add_argument("architecture", metavar="ARCH", help="the torchvision architecture, e.g. resnet50")
    up.add_argument("file", metavar="FILE", help="the state dict file, e.g. resnet50-0676ba61.pth")
    up.add_argument(
        "--no-check",
        action="store_true",
        help="send without checking the keys and shapes here (done with torch where it is installed)",
    )
    up.set_defaults(handler=_weights_upload)
    ls = verbs.add_parser("list", parents=[common], help="list stored weights, newest first")
    ls.add_argument("--architecture", metavar="ARCH", help="only this architecture's")
    ls.set_defaults(handler=_weights_list)
    show = verbs.add_parser("show", parents=[common], help="show stored weights")
    show.add_argument("id", help="weights id")
    show.set_defaults(handler=_weights_show)
    rm = verbs.add_parser("delete", parents=[common], help="delete stored weights (admin)")
    rm.add_argument("id", help="weights id")
    rm.set_defaults(handler=_weights_delete)
