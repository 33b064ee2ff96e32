"""Which optional part of torchyard a command needs, and a clear refusal when it is missing.

``pip install torchyard`` gives the CLI and the Python client only; the API and the worker
come with extras (README.md). Commands that need them import them lazily and call
:func:`require` first, so that a client-only install answers with one line naming the
extra to install rather than a traceback.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

#: The top-level modules each extra brings (``pip install 'torchyard[<extra>]'``).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "server": (
        "fastapi",
        "fastapi_offline",
        "uvicorn",
        "pydantic_settings",
        "sqlalchemy",
        "alembic",
        "psycopg",
        "python_multipart",
        "PIL",
        "onnxruntime",
    ),
    "worker": ("torch", "torchvision", "safetensors", "PIL", "numpy", "onnx", "onnxruntime"),
}
EXTRA_MODULES["all"] = (*dict.fromkeys(EXTRA_MODULES["server"] + EXTRA_MODULES["worker"]), "sklearn")


class MissingExtraError(Exception):
    """A command needs an extra that is not installed (the CLI exits 2 with this message)."""

    def __init__(self, command: str, extras: Iterable[str], missing: Iterable[str]) -> None:
        self.command = command
        self.extras = tuple(extras)
        self.missing = tuple(missing)
        named = " and ".join(self.extras)
        noun = "extras" if len(self.extras) > 1 else "extra"
        first = self.missing[0] if self.missing else "?"
        more = f" and {len(self.missing) - 1} more" if len(self.missing) > 1 else ""
        super().__init__(
            f"torchyard {command} needs the {named} {noun} (no module {first}{more} here):"
            f" pip install 'torchyard[{','.join(self.extras)}]'"
        )


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (none are imported)."""
    missing = []
    for name in EXTRA_MODULES[extra]:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def require(command: str, *extras: str) -> None:
    """Raise :class:`MissingExtraError` unless every module of ``extras`` is installed."""
    lacking = {extra: missing_modules(extra) for extra in extras}
    lacking = {extra: names for extra, names in lacking.items() if names}
    if lacking:
        missing = dict.fromkeys(name for names in lacking.values() for name in names)
        raise MissingExtraError(command, lacking, missing)


def extra_providing(module: str | None) -> str | None:
    """The extra that installs top-level ``module`` (``server`` before ``worker``), if any."""
    top = (module or "").partition(".")[0]
    return next((extra for extra, names in EXTRA_MODULES.items() if top in names), None)
