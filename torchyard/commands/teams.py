"""``torchyard queue``, ``torchyard team list|show|create|update`` and ``torchyard user
list|create|update`` (docs/teams.md): the waiting jobs in the order of the next scheduling
pass, teams with their quotas and use of them, and (admin token) who is in which team."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

from torchyard.apiclient.teams import PoolUsage, Quota, Team
from torchyard.commands.common import _answer, _client, _print_json
from torchyard.terminal import format_table, format_time

_QUOTA_KEYS = {"borrow": "borrowing_limit", "lend": "lending_limit"}


def parse_quota(text: str) -> Quota:
    """``--quota POOL=NOMINAL[,borrow=N][,lend=N]``: e.g. ``default=16,borrow=8,lend=4``."""
    parts = [p.strip() for p in text.split(",")]
    values: dict[str, Any] = {}
    for i, part in enumerate(parts):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"expected POOL=UNITS[,borrow=UNITS][,lend=UNITS] (e.g. default=16,borrow=8), got {text!r}"
            )
        if i == 0:
            values["pool"], values["nominal"] = key, int(value)
        elif key in _QUOTA_KEYS and _QUOTA_KEYS[key] not in values:
            values[_QUOTA_KEYS[key]] = int(value)
        else:
            raise argparse.ArgumentTypeError(
                f"a quota takes borrow= and lend= after POOL=UNITS, once each; not {key!r} in {text!r}"
            )
    return Quota(**values)


def usage_text(usage: PoolUsage | None) -> str:
    """``used/nominal``, with ``(+N)`` when the team borrows N past its quota."""
    if usage is None:
        return "-"
    text = f"{usage.used}/{usage.nominal}"
    return f"{text} (+{usage.borrowed})" if usage.borrowed else text


def quota_text(quota: Quota) -> str:
    parts = [f"{quota.pool}={quota.nominal}"]
    if quota.borrowing_limit is not None:
        parts.append(f"borrow={quota.borrowing_limit}")
    if quota.lending_limit is not None:
        parts.append(f"lend={quota.lending_limit}")
    return ",".join(parts)


def borrowing_lines(teams: Iterable[Team]) -> list[str]:
    """Who borrows from whom, per pool: ``vision borrows 8 from speech``. Units are not
    lent by one team to another: a borrower takes idle units, and each lender's ``lent`` is
    what of its idle nominal quota borrowers hold now (units no team owns are lent by none)."""
    pools: dict[str, tuple[list[tuple[str, int]], list[tuple[str, int]]]] = {}
    for team in teams:
        for use in team.usage:
            borrowers, lenders = pools.setdefault(use.pool, ([], []))
            if use.borrowed:
                borrowers.append((team.name, use.borrowed))
            if use.lent:
                lenders.append((team.name, use.lent))
    lines = []
    for pool, (borrowers, lenders) in sorted(pools.items()):
        if not borrowers:
            continue
        where = "" if pool == "default" else f" in pool {pool}"
        owned = sum(n for _, n in lenders)
        spare = sum(n for _, n in borrowers) - owned
        sources = [f"{name} ({n})" if len(lenders) > 1 else name for name, n in lenders]
        if spare > 0:
            sources.append(f"units no team owns ({spare})" if sources else "units no team owns")
        for name, n in borrowers:
            lines.append(f"{name} borrows {n}{where} from {', '.join(sources) or 'nobody'}")
    return lines


def _queue(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = client.queue()
    if args.json:
        _print_json(items)
        return 0
    if not items:
        print("no job is waiting")
        return 0
    rows = [
        (q.position, q.id, q.name, q.team, q.priority, q.units, usage_text(q.usage), q.reason or "")
        for q in items
    ]
    print(format_table(["POS", "JOB", "NAME", "TEAM", "PRIORITY", "UNITS", "TEAM USAGE", "REASON"], rows))
    return 0


def _usage_of(team: Team, pool: str = "default") -> PoolUsage | None:
    return next((u for u in team.usage if u.pool == pool), None)


def _team_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        teams = client.list_teams()
    if args.json:
        _print_json(teams)
        return 0
    rows = []
    for t in teams:
        use = _usage_of(t)
        rows.append(
            (
                t.name,
                f"{t.weight:g}",
                " ".join(quota_text(q) for q in t.quotas) or "none",
                usage_text(use),
                use.lent if use else 0,
                len(t.members),
            )
        )
    print(format_table(["TEAM", "WEIGHT", "QUOTAS", "USED", "LENT", "MEMBERS"], rows))
    lines = borrowing_lines(teams)
    if lines:
        print("\n" + "\n".join(lines))
    return 0


def _team_text(team: Team) -> str:
    lines = [
        f"team {team.name}",
        f"  weight:          {team.weight:g}",
        f"  preempt within:  {'yes' if team.preempt_within else 'no'}",
    ]
    if team.slurm_account:
        lines.append(f"  slurm account:   {team.slurm_account}")
    if team.kueue_queue:
        lines.append(f"  kueue queue:     {team.kueue_queue}")
    if team.created_at:
        lines.append(f"  created:         {format_time(team.created_at)}")
    lines.append(f"  members:         {', '.join(team.members) or 'none'}")
    if not team.quotas:
        lines.append("  quotas:          none (its jobs wait in the one line, as without teams)")
    lines.append("")
    lines.append(
        format_table(
            ["POOL", "NOMINAL", "BORROW LIMIT", "LEND LIMIT", "USED", "BORROWED", "LENT"],
            [
                (
                    u.pool,
                    u.nominal,
                    "none" if u.borrowing_limit is None else u.borrowing_limit,
                    "all" if u.lending_limit is None else u.lending_limit,
                    u.used,
                    u.borrowed,
                    u.lent,
                )
                for u in team.usage
            ],
        )
    )
    return "\n".join(lines)


def _team_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        team = client.get_team(args.name)
    return _answer(args, team, _team_text(team))


def _team_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.weight is not None:
        options["weight"] = args.weight
    if args.preempt_within is not None:
        options["preempt_within"] = args.preempt_within
    if args.slurm_account is not None:
        options["slurm_account"] = args.slurm_account
    if args.kueue_queue is not None:
        options["kueue_queue"] = args.kueue_queue
    return options


def _team_create(args: argparse.Namespace) -> int:
    with _client(args) as client:
        team = client.create_team(args.name, args.quotas or [], **_team_options(args))
    return _answer(args, team, _team_text(team))


def _team_update(args: argparse.Namespace) -> int:
    options = _team_options(args)
    if args.quotas is None and not options:
        raise ValueError(
            "nothing to change: give --quota, --weight, --preempt-within, --slurm-account or --kueue-queue"
        )
    with _client(args) as client:
        team = client.update_team(args.name, args.quotas, **options)
    return _answer(args, team, _team_text(team))


def _user_rows(users: Sequence[Any]) -> str:
    rows = [
        (
            u.name,
            "yes" if u.admin else "no",
            ", ".join(u.teams) or "none",
            "disabled" if u.disabled else "active",
            format_time(u.created_at) if u.created_at else "",
        )
        for u in users
    ]
    return format_table(["USER", "ADMIN", "TEAMS", "STATUS", "CREATED"], rows)


def _user_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        users = client.list_users()
    if args.json:
        _print_json(users)
        return 0
    print(_user_rows(users))
    return 0


def _user_create(args: argparse.Namespace) -> int:
    with _client(args) as client:
        user = client.create_user(args.name, args.teams or [], admin=args.admin)
    return _answer(args, user, _user_rows([user]))


def _user_update(args: argparse.Namespace) -> int:
    if args.teams is None and args.admin is None and args.disabled is None:
        raise ValueError("nothing to change: give --team, --admin/--no-admin or --disable/--enable")
    with _client(args) as client:
        user = client.update_user(args.name, teams=args.teams, admin=args.admin, disabled=args.disabled)
    return _answer(args, user, _user_rows([user]))


def _add_team_options(cmd: argparse.ArgumentParser, *, update: bool) -> None:
    cmd.add_argument("name", metavar="NAME", help="the team's name")
    cmd.add_argument(
        "--quota",
        dest="quotas",
        action="append",
        type=parse_quota,
        metavar="POOL=UNITS[,borrow=N][,lend=N]",
        help="units the team owns in a pool, how many more it may borrow (default: no limit) and how "
        "many of its idle ones others may borrow (default: all); repeat for more pools"
        + ("; replaces the team's quotas" if update else ""),
    )
    cmd.add_argument("--weight", type=float, help="fair-share weight (default 1)")
    cmd.add_argument(
        "--preempt-within",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a higher-priority job of the team may preempt a lower-priority one of it",
    )
    cmd.add_argument(
        "--slurm-account",
        metavar="ACCOUNT",
        help="sbatch --account for the team's jobs" + (" ('' clears it)" if update else ""),
    )
    cmd.add_argument(
        "--kueue-queue",
        metavar="QUEUE",
        help="Kueue's queue for the team's jobs" + (" ('' clears it)" if update else ""),
    )


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``queue``, ``team`` and ``user``."""
    queue = sub.add_parser(
        "queue",
        parents=[common],
        help="waiting jobs in the order of the next scheduling pass: team, its use of its quota, why each waits",
    )
    queue.set_defaults(handler=_queue)

    team = sub.add_parser("team", help="teams: quotas and their use (create and update: admin token)")
    team_sub = team.add_subparsers(dest="team_command", required=True)
    ls = team_sub.add_parser(
        "list", parents=[common], help="teams (admins: all; others: their own), and who borrows from whom"
    )
    ls.set_defaults(handler=_team_list)
    show = team_sub.add_parser("show", parents=[common], help="a team's quotas, use of them and members")
    show.add_argument("name", metavar="NAME", help="the team's name")
    show.set_defaults(handler=_team_show)
    create = team_sub.add_parser("create", parents=[common], help="create a team with its quotas (admin)")
    _add_team_options(create, update=False)
    create.set_defaults(handler=_team_create)
    update = team_sub.add_parser(
        "update", parents=[common], help="change a team's quotas or options; counts at the next pass (admin)"
    )
    _add_team_options(update, update=True)
    update.set_defaults(handler=_team_update)

    user = sub.add_parser("user", help="users and their teams (admin token)")
    user_sub = user.add_subparsers(dest="user_command", required=True)
    ls = user_sub.add_parser("list", parents=[common], help="users: admin or not, teams, disabled or not")
    ls.set_defaults(handler=_user_list)
    create = user_sub.add_parser(
        "create",
        parents=[common],
        help="create a user (give them a token: torchyard token create --user NAME ...)",
    )
    create.add_argument("name", metavar="NAME", help="the user's name")
    create.add_argument(
        "--team",
        dest="teams",
        action="append",
        metavar="TEAM",
        help="a team of theirs (repeat for more; the first is the default of their jobs; none: default)",
    )
    create.add_argument("--admin", action="store_true", help="an admin")
    create.set_defaults(handler=_user_create)
    update = user_sub.add_parser(
        "update", parents=[common], help="change a user's teams, admin flag, or disable them"
    )
    update.add_argument("name", metavar="NAME", help="the user's name")
    update.add_argument(
        "--team",
        dest="teams",
        action="append",
        metavar="TEAM",
        help="their teams, replacing the ones they have (repeat; the first is their default)",
    )
    update.add_argument(
        "--admin", action=argparse.BooleanOptionalAction, default=None, help="an admin, or not"
    )
    state = update.add_mutually_exclusive_group()
    state.add_argument(
        "--disable",
        dest="disabled",
        action="store_const",
        const=True,
        default=None,
        help="their tokens stop working at once",
    )
    state.add_argument(
        "--enable", dest="disabled", action="store_const", const=False, help="enable them again"
    )
    update.set_defaults(handler=_user_update)
