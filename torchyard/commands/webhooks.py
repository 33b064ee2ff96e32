"""``torchyard webhooks add|list|rm|deliveries``: your subscriptions to events of your jobs and
sweeps (docs/webhooks.md)."""

from __future__ import annotations

import argparse

from torchyard.commands.common import _answer, _client, _note, _print_json
from torchyard.contract.webhooks import EVENTS
from torchyard.terminal import format_table, format_time


def _webhooks_add(args: argparse.Namespace) -> int:
    with _client(args) as client:
        hook = client.create_webhook(args.target, args.events, team=args.team)
    if args.json:
        _print_json(hook)
        return 0
    print(hook.id)
    of = f" of team {hook.team}'s jobs and sweeps" if hook.team else ""
    _note(f"webhook {hook.id}: {', '.join(hook.events)}{of} to {hook.url}")
    _note(f"signing secret (shown this once; keep it where the receiver can read it): {hook.secret}")
    return 0


def _webhooks_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        hooks = client.list_webhooks()
    if args.json:
        _print_json(hooks)
        return 0
    rows = [(h.id, h.url, ", ".join(h.events), h.team or "", format_time(h.created_at)) for h in hooks]
    print(format_table(["ID", "URL", "EVENTS", "TEAM", "CREATED"], rows))
    return 0


def _webhooks_rm(args: argparse.Namespace) -> int:
    with _client(args) as client:
        hook = client.delete_webhook(args.id)
    return _answer(args, hook, f"deleted webhook {hook.id} ({hook.url}): nothing more is sent to it")


def _webhooks_deliveries(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.webhook_deliveries(args.id, limit=args.limit)
    if args.json:
        _print_json(page)
        return 0
    rows = [
        (
            d.id,
            d.event,
            d.status,
            str(d.attempts),
            "" if d.last_status is None else str(d.last_status),
            format_time(d.created_at),
            format_time(d.next_attempt_at) if d.next_attempt_at else "",
            (d.last_response or "").replace("\n", " ")[:60],
        )
        for d in page.items
    ]
    print(format_table(["ID", "EVENT", "STATUS", "TRIES", "LAST", "CREATED", "NEXT TRY", "ANSWER"], rows))
    return 0


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``webhooks`` and its verbs."""
    webhooks = sub.add_parser(
        "webhooks", help="subscribe a URL to events of your jobs and sweeps, signed (docs/webhooks.md)"
    )
    verbs = webhooks.add_subparsers(dest="webhooks_command", required=True)
    add = verbs.add_parser(
        "add", parents=[common], help="subscribe URL to events; prints the id, and the signing secret once"
    )
    add.add_argument("target", metavar="URL", help="the http:// or https:// URL the events are POSTed to")
    add.add_argument(
        "--event",
        dest="events",
        action="append",
        required=True,
        choices=EVENTS,
        metavar="EVENT",
        help=f"an event to deliver (repeat for more): {', '.join(EVENTS)}",
    )
    add.add_argument(
        "--team",
        metavar="TEAM",
        help="the events of every job and sweep of TEAM (one of yours, not default), whoever submitted it",
    )
    add.set_defaults(handler=_webhooks_add)
    ls = verbs.add_parser(
        "list", parents=[common], help="list your webhooks and your teams' (never their secrets)"
    )
    ls.set_defaults(handler=_webhooks_list)
    rm = verbs.add_parser("rm", parents=[common], help="delete a webhook: nothing more is sent to it")
    rm.add_argument("id", metavar="ID", help="webhook id")
    rm.set_defaults(handler=_webhooks_rm)
    deliveries = verbs.add_parser(
        "deliveries",
        parents=[common],
        help="what was sent to a webhook, newest first: event, status, tries, the last answer",
    )
    deliveries.add_argument("id", metavar="ID", help="webhook id")
    deliveries.add_argument("--limit", type=int, default=50, help="how many (at most 200; default 50)")
    deliveries.set_defaults(handler=_webhooks_deliveries)
