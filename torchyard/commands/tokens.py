"""``torchyard token list|revoke``, through the API (admin token)."""

from __future__ import annotations

import argparse

from torchyard.commands.common import _answer, _client, _print_json, client_options
from torchyard.terminal import (
    format_table,
    format_time,
)


def _tokens_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        tokens = client.list_tokens(include_revoked=not args.active)
    if args.json:
        _print_json(tokens)
        return 0
    rows = [
        (
            t.id,
            t.name,
            t.role,
            format_time(t.created_at),
            format_time(t.last_used_at) if t.last_used_at else "never",
            f"revoked {format_time(t.revoked_at)}" if t.revoked_at else "active",
        )
        for t in tokens
    ]
    print(format_table(["ID", "NAME", "ROLE", "CREATED", "LAST USED", "STATUS"], rows))
    return 0


def _token_revoke(args: argparse.Namespace) -> int:
    with _client(args) as client:
        tokens = client.list_tokens()
        if not any(t.id == args.token_ref for t in tokens):
            # Not an id: a name, if exactly one token that is still valid bears it.
            named = [t for t in tokens if t.name == args.token_ref and t.revoked_at is None]
            if len(named) > 1:
                ids = ", ".join(t.id for t in named)
                raise ValueError(
                    f"{len(named)} valid tokens are named {args.token_ref!r} ({ids}): give the id"
                )
            if not named:
                raise ValueError(f"no token has the id {args.token_ref!r}, and no valid token that name")
            args.token_ref = named[0].id
        token = client.revoke_token(args.token_ref)
    return _answer(
        args, token, f"revoked token {token.id} ({token.name}, {token.role}): requests with it now get 401"
    )


def register_token_commands(
    token_sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """``torchyard token list`` and ``token revoke``, through the API (admin token)."""
    common = client_options()
    ls = token_sub.add_parser(
        "list", parents=[common], help="list tokens: id, name, role, created, last used (never the secret)"
    )
    ls.add_argument("--active", action="store_true", help="leave out revoked tokens")
    ls.set_defaults(handler=_tokens_list)
    revoke = token_sub.add_parser(
        "revoke", parents=[common], help="revoke a token: every request with it gets 401 from now on"
    )
    revoke.add_argument(
        "token_ref", metavar="ID", help="the token's id (or its name, when one valid token has it)"
    )
    revoke.set_defaults(handler=_token_revoke)
