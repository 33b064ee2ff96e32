"""``torchyard login`` and ``logout``: sign in with the API's OpenID provider (docs/oidc.md)."""

from __future__ import annotations

import argparse

from torchyard.apiclient import login as login_calls
from torchyard.apiclient.connection import resolve_url


def _login(args: argparse.Namespace) -> int:
    url = resolve_url(getattr(args, "url", None))
    login_calls.device_login(url, say=lambda line: print(line, flush=True))
    print(f"Signed in to {url}; credentials in {login_calls.credentials_path()}")
    return 0


def _logout(args: argparse.Namespace) -> int:
    url = resolve_url(getattr(args, "url", None))
    if login_calls.logout(url):
        print(f"Signed out of {url}")
    else:
        print(f"Not signed in to {url}")
    return 0


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    login = sub.add_parser(
        "login",
        parents=[common],
        help="sign in with the API's OpenID provider: prints a URL and a code to enter there (works over SSH)",
    )
    login.set_defaults(handler=_login)
    logout = sub.add_parser("logout", parents=[common], help="forget the credentials of `torchyard login`")
    logout.set_defaults(handler=_logout)
