"""``submit`` and ``clone``: a job sent to the service, and with ``--follow`` its live
progress until it ends."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from torchyard.client import Client, Job
from torchyard.commands.common import (
    _JOB_HELP,
    _client,
    _note,
    _print_json,
    _resolve_datasets,
    load_spec,
    parse_value,
    set_path,
)
from torchyard.contract.jobspec import JobKind
from torchyard.terminal import LiveProgress

# Handy submit flags: (flag, spec path, type, help).
_SUBMIT_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--arch", "model.architecture", str, "torchvision architecture, e.g. resnet18"),
    ("--init-from-job", "model.init_from_job", str, "fine-tune from a succeeded job's model"),
    ("--epochs", "parameters.epochs", int, "passes over the training set"),
    ("--batch-size", "parameters.batch_size", int, "images per batch per process"),
    ("--warmup-epochs", "parameters.warmup_epochs", int, "epochs of linear warm-up"),
    ("--lr", "parameters.learning_rate", float, "initial learning rate"),
    ("--seed", "parameters.random_seed", int, "random seed"),
    ("--patience", "parameters.patience", int, "early-stopping patience (epochs)"),
    ("--print-frequency", "parameters.print_frequency", int, "a training log line every N iterations"),
    ("--image-size", "parameters.image_size", int, "training/eval crop size (16..1024)"),
    ("--augmentation", "parameters.augmentation", str, "standard, light or none"),
    ("--nodes", "resources.node_count", int, "nodes to train on"),
    ("--procs", "resources.process_count_per_node", int, "processes (ranks) per node"),
    ("--max-runtime", "resources.max_runtime_s", int, "seconds the job may run before TimeoutError"),
    ("--max-restarts", "resources.max_restarts", int, "restarts after retryable failures (0..100)"),
    ("--hang-timeout", "resources.hang_timeout_s", int, "seconds without a training step before HangError"),
    ("--priority", "priority", int, "higher runs first (-100..100)"),
)

# Spec fields that flags of their own set: (argument, field).
_NAMED_FLAGS: tuple[tuple[str, str], ...] = (
    ("name", "name"),
    ("train", "train_dataset"),
    ("val", "validation_dataset"),
)


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The spec file, then the handy flags, then ``--set`` overrides (most explicit wins)."""
    spec = load_spec(args.spec) if args.spec else {}
    for name, key in _NAMED_FLAGS:
        value = getattr(args, name)
        if value is not None:
            spec[key] = value
    if args.pretrained:
        set_path(spec, "model.pretrained", True)
    for flag, dotted, _type, _help in _SUBMIT_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            set_path(spec, dotted, value)
    _apply_sets(spec, args.set or [])
    return spec


def _apply_sets(spec: dict[str, Any], items: list[str]) -> None:
    """``--set KEY=VALUE`` overrides, in the order given."""
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        set_path(spec, key.strip(), parse_value(raw))


def follow_job(client: Client, job: Job, *, show_logs: bool = False, out: Any = None) -> Job:
    """Print a job's live progress until it ends; return the final job."""
    progress = LiveProgress(
        out,
        show_logs=show_logs,
        epochs=job.parameters.get("epochs"),
        by="epoch" if job.type == JobKind.TRAIN else None,
    )
    for event in client.events(job.id, logs=show_logs, ranks=[0] if show_logs else None):
        progress.handle(event.kind, event.data)
    return client.get_job(job.id)


def _submit(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    with _client(args) as client:
        _resolve_datasets(client, spec)
        if args.dry_run:
            _print_json(spec)
            return 0
        job = client.submit_job(spec)
        if args.json and not args.follow:
            _print_json(job)
            return 0
        print(job.id)
        what = (
            job.model.get("architecture")
            if isinstance(job.model, dict) and job.type == JobKind.TRAIN
            else f"{job.type} job"
        )
        _note(f"submitted job {job.name!r} ({what}), status {job.status}")
        if not args.follow:
            _note(f"follow it with: torchyard logs {job.id} -f   or   torchyard metrics {job.id} --watch")
            return 0
        final = follow_job(client, job, show_logs=args.logs, out=sys.stderr if args.json else None)
    if args.json:
        _print_json(final)
    return 0 if final.status == "succeeded" else 1


def _clone(args: argparse.Namespace) -> int:
    with _client(args) as client:
        source = client.get_job(args.id)
        job = client.clone_job(source.id)
        if args.json and not args.follow:
            _print_json(job)
            return 0
        print(job.id)
        _note(f"submitted job {job.name!r} again as {job.id}, status {job.status}")
        if not args.follow:
            return 0
        final = follow_job(client, job, out=sys.stderr if args.json else None)
    if args.json:
        _print_json(final)
    return 0 if final.status == "succeeded" else 1


def add_submit(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``submit``."""
    submit = sub.add_parser(
        "submit",
        parents=[common],
        help="submit a training job from a YAML/JSON spec, with flag overrides",
        description="Submit a job. Fields come from SPEC, then the flags below, then --set KEY=VALUE "
        "(e.g. --set parameters.epochs=3). Dataset fields accept an id or a dataset name.",
    )
    submit.add_argument("spec", nargs="?", help="job spec file (.yaml, .yml or .json; - for stdin)")
    submit.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a spec field by its dotted path"
    )
    submit.add_argument("--name", help="job name")
    submit.add_argument("--train", help="training dataset (id or name)")
    submit.add_argument("--val", help="validation dataset (id or name)")
    submit.add_argument(
        "--pretrained",
        action="store_true",
        default=None,
        help="start from pretrained weights (docs/fine-tuning.md)",
    )
    for flag, _dotted, kind, text in _SUBMIT_FLAGS:
        submit.add_argument(flag, type=kind, default=None, help=text)
    submit.add_argument("--follow", "-f", action="store_true", help="show live progress until the job ends")
    submit.add_argument("--logs", action="store_true", help="with --follow: also print rank 0's log")
    submit.add_argument("--dry-run", action="store_true", help="print the spec that would be sent")
    submit.set_defaults(handler=_submit)


def add_clone(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``clone`` (or ``resubmit``)."""
    clone = sub.add_parser(
        "clone",
        aliases=["resubmit"],
        parents=[common],
        help="submit a job's spec again as a new job",
        description="Submit a job's spec again as a new job (any status): same model, datasets, "
        "parameters and resources, or for a script job the same code, command and inputs.",
    )
    clone.add_argument("id", metavar="JOB", help=_JOB_HELP)
    clone.add_argument("--follow", "-f", action="store_true", help="show live progress until the job ends")
    clone.set_defaults(handler=_clone)
