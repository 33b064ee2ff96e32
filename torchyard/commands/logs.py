"""``torchyard logs``: a job's log, once or followed."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import TextIO

from torchyard.client import Client, Job
from torchyard.commands.common import _JOB_HELP, _client, _positive_int, parse_since
from torchyard.commands.metrics import requeue_note
from torchyard.terminal import (
    EpochTable,
    timing_text,
)

log = logging.getLogger(__name__)


def _epoch_notes(client: Client, job: Job, out: TextIO) -> None:
    """A line on ``out`` as each epoch of ``job`` ends, with the elapsed training time
    and an estimate of the time left; returns when the job ends."""
    epochs = job.parameters.get("epochs")
    table = EpochTable()
    noted: set[int] = set()
    for event in client.events(job.id, logs=False):
        note = requeue_note(event)
        if note:
            out.write(note + "\n")
            out.flush()
        if event.kind != "metric":
            continue
        epoch = table.add(event.data)
        if table.is_complete(epoch) and epoch not in noted:
            noted.add(epoch)
            timing = timing_text(*table.timing(epoch, epochs))
            total = f"/{epochs}" if epochs else ""
            out.write(f"-- epoch {epoch}{total} done" + (f": {timing}" if timing else "") + "\n")
            out.flush()


def _logs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.follow:
            job = client.get_job(args.id)
            # Epoch progress goes to stderr beside the log, from a second connection, so
            # that stdout stays the log's exact text.
            notes = threading.Thread(target=_notes_quietly, args=(args, job), name="epoch-notes", daemon=True)
            if not args.json:
                notes.start()
            for text in client.follow_logs(
                job.id,
                rank=args.rank,
                stream=args.stream,
                offset=args.offset,
                attempt=args.attempt,
                tail=args.tail,
                since=args.since,
            ):
                sys.stdout.write(text)
                sys.stdout.flush()
            if notes.is_alive():
                notes.join(timeout=30.0)  # the job is over: its last epoch's note is on its way
        else:
            sys.stdout.write(
                client.logs(
                    args.id,
                    rank=args.rank,
                    stream=args.stream,
                    offset=args.offset,
                    attempt=args.attempt,
                    tail=args.tail,
                    since=args.since,
                )
            )
    sys.stdout.flush()
    return 0


def _notes_quietly(args: argparse.Namespace, job: Job) -> None:
    try:
        with Client(args.url, args.token) as client:
            _epoch_notes(client, job, sys.stderr)
    except Exception as exc:  # progress notes are a convenience: the log itself carries on
        log.debug("epoch progress notes stopped: %s", exc)


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``logs``."""
    logs = sub.add_parser("logs", parents=[common], help="a job's log (rank 0 unless --rank/--stream)")
    logs.add_argument("id", metavar="JOB", help=_JOB_HELP)
    logs.add_argument("-f", "--follow", action="store_true", help="stream new lines until the job ends")
    logs.add_argument("--rank", type=int, default=None, help="global rank (default 0)")
    logs.add_argument("--stream", default=None, help="a stream by name, e.g. the agent log")
    logs.add_argument("--offset", type=int, default=0, help="start at this byte offset")
    logs.add_argument("--attempt", type=int, default=None, help="this attempt's log (default: the latest)")
    logs.add_argument(
        "--tail", "-n", type=_positive_int, default=None, metavar="N", help="start with the last N lines"
    )
    logs.add_argument(
        "--since",
        type=parse_since,
        default=None,
        metavar="WHEN",
        help="only text that arrived since WHEN: a duration ago (30s, 10m, 2h, 1d) or an ISO 8601 time",
    )
    logs.set_defaults(handler=_logs)
