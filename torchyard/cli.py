"""The ``torchyard`` command."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from types import ModuleType

from pydantic import ValidationError

from torchyard import __version__, commands, demo
from torchyard.client import ServiceUnreachableError
from torchyard.commands.common import SpecFileError, add_client_options
from torchyard.contract.errors import TorchyardError
from torchyard.extras import MissingExtraError, extra_providing

Handler = Callable[[argparse.Namespace], int]

# The parts that add commands of their own (``serve``, ``db``, ``token create``; ``worker``),
# by their ``torchyard.commands`` entry points; these when the installed metadata has none.
ENTRY_POINT_GROUP = "torchyard.commands"
BUILT_IN_PARTS = ("service.commands", "worker.commands")


def command_parts() -> list[ModuleType]:
    """The modules of the parts that add commands: the CLI composes them, and imports none
    of them by name (they sit above it, beside the contract it shares with them)."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    names = [ep.value for ep in found] or list(BUILT_IN_PARTS)
    return [importlib.import_module(name) for name in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchyard", description="Train PyTorch image classifiers on a cluster."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"torchyard {__version__}")
    add_client_options(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    parts = command_parts()
    for part in parts:
        if hasattr(part, "register"):
            part.register(sub)
    token = sub.add_parser("token", help="API tokens: create (database), list and revoke (API, admin token)")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    for part in parts:
        if hasattr(part, "register_token"):
            part.register_token(token_sub)
    commands.register_token_commands(token_sub)

    commands.register(sub)
    demo.register(sub)
    _accept_global_options(parser)
    return parser


# The options of the ``torchyard`` parser that each command accepts after its name too.
GLOBAL_OPTIONS = frozenset({"verbose", "url", "token", "json"})


def _accept_global_options(parser: argparse.ArgumentParser) -> None:
    """Let ``-v`` follow every command, and keep a global option given before a command:
    a command's own ``--url``, ``--token``, ``--json`` and ``-v`` default to nothing
    (``SUPPRESS``), so they set the value only when given after the command's name."""
    seen: set[int] = set()
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            if not isinstance(action, argparse._SubParsersAction):
                continue
            for child in action.choices.values():
                if id(child) in seen:  # an alias names the same parser
                    continue
                seen.add(id(child))
                for option in child._actions:
                    if option.dest in GLOBAL_OPTIONS:
                        option.default = argparse.SUPPRESS
                if "-v" not in child._option_string_actions:
                    child.add_argument(
                        "-v",
                        "--verbose",
                        action="store_true",
                        default=argparse.SUPPRESS,
                        help="debug logging",
                    )
                stack.append(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except MissingExtraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        return _missing_module(args.command, exc)
    except ServiceUnreachableError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 3
    except TorchyardError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        return _invalid_settings(exc)
    except SpecFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # One line per HTTP request would bury what the commands print.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        # Alembic names each of its plugins as it is imported.
        logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def _missing_module(command: str, exc: ModuleNotFoundError) -> int:
    """A part of an extra that the checks of the commands did not foresee: still one line,
    not a traceback. A module of no extra is raised again."""
    extra = extra_providing(exc.name)
    if extra is None:
        raise exc
    print(f"error: {MissingExtraError(command, [extra], [exc.name or extra])}", file=sys.stderr)
    return 2


def _invalid_settings(exc: ValidationError) -> int:
    """Invalid settings, one line each; any other validation error is raised again."""
    if exc.title != "Settings":
        raise exc
    for line in settings_errors(exc):
        print(f"error: {line}", file=sys.stderr)
    return 2


def settings_errors(exc: ValidationError) -> list[str]:
    """One line per invalid setting, named as the environment variable that sets it."""
    lines = []
    for error in exc.errors():
        where = f"TORCHYARD_{str(error['loc'][0]).upper()}" if error["loc"] else "settings"
        given = error.get("input")
        shown = "" if given is None or isinstance(given, dict) else f" (got {given!r})"
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"InvalidSettingsError: {where}: {message}{shown}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
