"""``torchyard audit`` and ``torchyard audit export``: the audit trail (docs/audit.md), for
admins: every change made through the API, with who, when, from where and what."""

from __future__ import annotations

import argparse
import sys

from torchyard.commands.common import _client, _print_json, parse_since
from torchyard.contract.audit import AuditEventPublic
from torchyard.terminal import format_table, format_time


def _actor(event: AuditEventPublic) -> str:
    actor = event.actor
    if actor.name is None and actor.token_name is None:
        return "-"
    if actor.token_name and actor.token_name != actor.name:
        return f"{actor.name} ({actor.token_name})"
    return str(actor.name or actor.token_name)


def _target(event: AuditEventPublic) -> str:
    if event.target.id is None:
        return event.target.kind or "-"
    return f"{event.target.kind}:{event.target.id}" if event.target.kind else event.target.id


def _audit_list(args: argparse.Namespace) -> int:
    events: list[AuditEventPublic] = []
    cursor = None
    with _client(args) as client:
        while len(events) < args.limit:
            page = client.audit_events(
                actor=args.actor,
                action=args.action,
                target=args.target,
                since=args.since,
                until=args.until,
                limit=min(500, args.limit - len(events)),
                cursor=cursor,
            )
            events += page.items
            cursor = page.next_cursor
            if not cursor:
                break
    if args.json:
        _print_json(events)
        return 0
    rows = [
        (
            format_time(e.at),
            _actor(e),
            e.via,
            e.source or "-",
            e.action,
            _target(e),
            str(e.outcome),
        )
        for e in events
    ]
    print(format_table(["AT", "ACTOR", "VIA", "FROM", "ACTION", "TARGET", "STATUS"], rows))
    return 0


def _audit_export(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    with _client(args) as client:
        for chunk in client.audit_export(
            actor=args.actor, action=args.action, since=args.since, until=args.until
        ):
            out.write(chunk)
    out.flush()
    return 0


def _filters(parser: argparse.ArgumentParser, *, target: bool) -> None:
    parser.add_argument("--actor", help="only this actor's events: a user's name, or a token's name or id")
    parser.add_argument(
        "--action", help="only actions starting with this: job. (every job action), job.cancel"
    )
    if target:
        parser.add_argument("--target", help="only events about this target: its id or name, or KIND:ID")
    parser.add_argument(
        "--since", type=parse_since, help="only events since: a duration (10m, 2h, 1d) or an ISO 8601 time"
    )
    parser.add_argument(
        "--until", type=parse_since, help="only events before: a duration or an ISO 8601 time"
    )


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``audit`` (the newest events) and ``audit export`` (every event, JSON lines)."""
    audit = sub.add_parser(
        "audit",
        parents=[common],
        help="admins: the changes made through the API, newest first: who, via, from where, what "
        "(docs/audit.md)",
    )
    _filters(audit, target=True)
    audit.add_argument("--limit", type=int, default=50, help="how many events (default 50)")
    audit.set_defaults(handler=_audit_list)
    verbs = audit.add_subparsers(dest="audit_command")
    export = verbs.add_parser(
        "export",
        parents=[common],
        help="every event as JSON lines, oldest first, to stdout (torchyard audit export > audit.jsonl)",
    )
    _filters(export, target=False)
    export.set_defaults(handler=_audit_export)
