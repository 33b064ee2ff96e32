"""Where the client finds the API: its URL, the token, and the local data directory."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_DATA_DIR = "./torchyard-data"


def data_dir() -> Path:
    """The local data directory: ``TORCHYARD_DATA_DIR`` or ``./torchyard-data``."""
    return Path(os.environ.get("TORCHYARD_DATA_DIR") or DEFAULT_DATA_DIR)


def resolve_url(url: str | None = None) -> str:
    """The API URL: the argument, else ``TORCHYARD_URL``, else the local default."""
    return (url or os.environ.get("TORCHYARD_URL") or DEFAULT_URL).rstrip("/")


def resolve_token(token: str | None = None, url: str | None = None) -> str | None:
    """The token: the argument, else ``TORCHYARD_TOKEN``, else the access token of a
    ``torchyard login`` to ``url`` (renewed when it expires), else the local data dir's admin token.

    The last one lets a user of a local ``torchyard serve`` run every command without
    ever copying a token.
    """
    if token:
        return token
    env = os.environ.get("TORCHYARD_TOKEN")
    if env:
        return env.strip()
    if url is not None:
        from torchyard.apiclient.login import access_token

        signed_in = access_token(url)
        if signed_in:
            return signed_in
    path = data_dir() / "admin.token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def missing_token_message() -> str:
    """Why no token was found: where :func:`resolve_token` looked, and how to give one."""
    path = data_dir() / "admin.token"
    try:
        path.read_text()
        why = "is empty"
    except FileNotFoundError:
        why = "does not exist"
    except OSError as exc:
        why = f"cannot be read ({exc.strerror or exc})"
    default = (
        ""
        if os.environ.get("TORCHYARD_DATA_DIR")
        else " (TORCHYARD_DATA_DIR is not set: the default is used)"
    )
    return (
        f"no API token: --token and TORCHYARD_TOKEN are not set, and the local service's token file "
        f"{path} {why}{default}. Set TORCHYARD_TOKEN to a token, or TORCHYARD_DATA_DIR to the data "
        "directory of the service you started (e.g. TORCHYARD_DATA_DIR=torchyard-demo/data after the demo)"
    )
