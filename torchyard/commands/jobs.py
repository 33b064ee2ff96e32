"""``jobs``: the job list; and the job commands registered together, in the order
``torchyard --help`` lists them: ``submit`` (:mod:`job_submit`), ``jobs``, ``show``
(:mod:`job_show`), ``delete``, ``tag``, ``note`` (:mod:`job_changes`), ``clone``,
``cancel`` and ``download`` (:mod:`job_download`)."""

from __future__ import annotations

import argparse
from typing import Any

from torchyard.client import Job
from torchyard.commands import job_changes, job_download, job_show, job_submit
from torchyard.commands.common import _client, _print_json
from torchyard.terminal import format_duration, format_table, format_time

# The widest the TAGS column of ``torchyard jobs`` gets: more is cut short with "…".
TAGS_WIDTH = 24


def tags_text(tags: list[str], width: int = TAGS_WIDTH) -> str:
    """A job's tags for a table column: ``a,b,c``, cut short with ``…`` past ``width``."""
    text = ",".join(tags)
    return text if len(text) <= width else text[: width - 1] + "…"


def _progress_text(job: Job) -> str:
    """``epoch 2/5 43%`` (the parts known), ``-`` before any progress."""
    progress = job.progress or {}
    epoch, epochs = progress.get("epoch"), progress.get("epochs") or job.parameters.get("epochs")
    fraction = progress.get("fraction")
    parts = []
    if epoch is not None:
        parts.append(f"epoch {epoch}/{epochs}" if epochs else f"epoch {epoch}")
    if isinstance(fraction, int | float):
        parts.append(f"{fraction:.0%}")
    return " ".join(parts) or "-"


def _eta_text(job: Job) -> str:
    """The time the job has left at its recent rate (``-`` when unknown)."""
    eta = (job.progress or {}).get("eta_s")
    return format_duration(eta) if isinstance(eta, int | float) else "-"


def _best_top1(job: Job) -> str:
    best = job.best or {}
    value = best.get("val.top1", best.get("top1"))
    return f"{float(value):.2%}" if isinstance(value, int | float) else "-"


def _jobs(args: argparse.Namespace) -> int:
    filters: dict[str, Any] = {"status": args.status, "tag": args.tag, "sweep": args.sweep}
    with _client(args) as client:
        if args.all:
            items = list(client.iter_jobs(**filters))
        else:
            items = client.list_jobs(limit=args.limit, **filters).items
    if args.json:
        _print_json(items)
        return 0
    rows = [
        (
            j.id,
            j.name,
            j.status,
            _progress_text(j),
            _eta_text(j),
            _best_top1(j),
            tags_text(j.tags) or "-",
            format_time(j.created_at),
        )
        for j in items
    ]
    print(format_table(["ID", "NAME", "STATUS", "PROGRESS", "ETA", "BEST TOP-1", "TAGS", "CREATED"], rows))
    return 0


def _add_jobs(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    jobs = sub.add_parser("jobs", parents=[common], help="list jobs, newest first")
    jobs.add_argument("--status", action="append", help="only jobs with this status (repeatable)")
    jobs.add_argument(
        "--tag", action="append", help="only jobs with this tag (repeatable: jobs with every one of them)"
    )
    jobs.add_argument(
        "--sweep", metavar="SWEEP", help="only the trials of this sweep (id, name or id prefix)"
    )
    jobs.add_argument("--limit", type=int, default=50)
    jobs.add_argument("--all", action="store_true", help="every page")
    jobs.set_defaults(handler=_jobs)


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The job commands."""
    job_submit.add_submit(sub, common)
    _add_jobs(sub, common)
    job_show.add_show(sub, common)
    job_changes.add_delete(sub, common)
    job_changes.add_tag_and_note(sub, common)
    job_submit.add_clone(sub, common)
    job_changes.add_cancel(sub, common)
    job_download.add_download(sub, common)
