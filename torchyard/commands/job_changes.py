"""The commands that change a job: ``tag``, ``note``, ``cancel`` and ``delete``."""

from __future__ import annotations

import argparse

from torchyard.commands.common import _JOB_HELP, _answer, _client, _note


def _delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        deleted = client.delete_job(args.id)
    return _answer(
        args,
        deleted,
        f"deleted job {deleted['id']} ({deleted['name']}): its metrics, logs, checkpoints and files",
    )


def _tag(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.get_job(args.id)
        tags = list(job.tags)
        if args.remove:
            missing = [t for t in args.tags if t not in tags]
            if missing:
                raise ValueError(f"job {job.id} has no tag {', '.join(map(repr, missing))}")
            tags = [t for t in tags if t not in args.tags]
        else:
            tags += [t for t in args.tags if t not in tags]
        job = client.update_job(job.id, tags=tags)
    return _answer(args, job, f"{job.id} tags: {', '.join(job.tags) or '-'}")


def _note_command(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.update_job(args.id, note=args.text or None)
    return _answer(args, job, f"{job.id} note: {job.note or '-'}")


def _cancel(args: argparse.Namespace) -> int:
    """Cancel a job; one that had already ended is left as it is, said on stderr, and is
    no failure (exit status 0), as with ``sweep cancel``."""
    with _client(args) as client:
        before = client.get_job(args.id)
        job = client.cancel_job(before.id)
        if args.wait and not job.is_final:
            job = client.wait(job.id)
    if before.is_final and before.status != "cancelled":
        _note(f"job {job.id} had already ended ({job.status}): there was nothing to cancel")
    return _answer(args, job, f"{job.id} {job.status}")


def add_delete(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``delete``."""
    delete_job = sub.add_parser(
        "delete",
        parents=[common],
        help="delete a finished job with its metrics, logs, checkpoints, model directory and outputs",
        description="Delete a finished job: its metrics, logs, checkpoints, model directory and outputs "
        "go. A job that has not ended is refused (cancel it first), and so is one whose model is a "
        "registered model version (delete the version first).",
    )
    delete_job.add_argument("id", metavar="JOB", help=_JOB_HELP)
    delete_job.set_defaults(handler=_delete)


def add_tag_and_note(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``tag`` and ``note``."""
    tag = sub.add_parser("tag", parents=[common], help="add tags to a job (or --remove them)")
    tag.add_argument("id", metavar="JOB", help=_JOB_HELP)
    tag.add_argument("tags", nargs="+", metavar="TAG", help="a label without spaces or commas")
    tag.add_argument("--remove", action="store_true", help="remove these tags instead")
    tag.set_defaults(handler=_tag)

    note = sub.add_parser("note", parents=[common], help="set a job's note (an empty TEXT clears it)")
    note.add_argument("id", metavar="JOB", help=_JOB_HELP)
    note.add_argument("text", metavar="TEXT", help="free text, up to 10,000 characters")
    note.set_defaults(handler=_note_command)


def add_cancel(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``cancel``."""
    cancel = sub.add_parser(
        "cancel",
        parents=[common],
        help="cancel a job (idempotent; a job that had already ended is said so, exit status 0)",
    )
    cancel.add_argument("id", metavar="JOB", help=_JOB_HELP)
    cancel.add_argument("--wait", action="store_true", help="wait until the job is cancelled")
    cancel.set_defaults(handler=_cancel)
