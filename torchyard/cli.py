"""The ``torchyard`` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from torchyard import __version__, commands, demo
from torchyard.client import ServiceUnreachableError
from torchyard.contract.errors import TorchyardError
from torchyard.extras import MissingExtraError, extra_providing, require

Handler = Callable[[argparse.Namespace], int]


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {value!r}")
    return number


def _serve(args: argparse.Namespace) -> int:
    if args.with_worker:
        require("serve --with-worker", "server", "worker")
    else:
        require("serve", "server")
    from service.config import Settings
    from torchyard.serving import serve

    overrides: dict[str, object] = {}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    settings = Settings(**overrides)  # type: ignore[arg-type]
    return serve(
        settings,
        with_worker=args.with_worker,
        worker_name=args.worker_name,
        worker_slots=args.worker_slots,
        log_level="debug" if args.verbose else args.log_level,
        workers=args.workers,
    )


def _quiet_migrations(args: argparse.Namespace) -> None:
    """Alembic's own lines (its set-up, each migration) only with --verbose: the command
    prints its one line of result."""
    if not args.verbose:
        logging.getLogger("alembic").setLevel(logging.WARNING)


def _db_upgrade(args: argparse.Namespace) -> int:
    require("db upgrade", "server")
    from service.config import Settings
    from service.db.migrate import upgrade

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _quiet_migrations(args)
    upgrade(settings.sqlalchemy_url)
    print(f"database at head: {settings.sqlalchemy_url.split('@')[-1]}")
    return 0


def _token_create(args: argparse.Namespace) -> int:
    require("token create", "server")
    from service.config import Settings
    from service.db.engine import Database
    from service.db.migrate import upgrade
    from service.services.tokens import create_token
    from service.states import Role

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _quiet_migrations(args)
    upgrade(settings.sqlalchemy_url)
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            _row, plain = create_token(session, args.name, Role(args.role))
    finally:
        db.dispose()
    print(plain)
    return 0


def _worker(args: argparse.Namespace) -> int:
    require("worker", "worker")
    from worker.agent.main import run

    return run(args)


def _launch(args: argparse.Namespace) -> int:
    require("launch", "worker")
    from worker.agent.launch import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchyard", description="Train PyTorch image classifiers on a cluster."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"torchyard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the API service",
        description="Run the API service and the web UI (http://HOST:PORT/). Settings come from "
        "TORCHYARD_* environment variables (README: Configuration); the options below override "
        "them. The first start writes an admin token to <data dir>/admin.token. Clients of a "
        "service on another port or host need TORCHYARD_URL (or --url).",
    )
    serve.add_argument(
        "--data-dir",
        default=None,
        help="artifact store: SQLite file, datasets, models, admin token "
        "(default: $TORCHYARD_DATA_DIR, else ./torchyard-data)",
    )
    serve.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    serve.add_argument(
        "--with-worker", action="store_true", help="also run one local worker agent on this machine"
    )
    serve.add_argument(
        "--worker-name", default=None, help="node name of the local worker (default <host>-local)"
    )
    serve.add_argument("--worker-slots", type=int, default=None, help="CPU slots of the local worker")
    serve.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="API processes serving the address (default 1; above 1 needs PostgreSQL): one "
        "process answers on one core",
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="info (default) leaves out routine lines (worker heartbeat/claim and health-check "
        "requests, migration set-up); debug shows them",
    )
    serve.set_defaults(handler=_serve)

    from worker.agent.main import add_arguments as add_worker_arguments

    worker = sub.add_parser("worker", help="run a worker agent on this node")
    add_worker_arguments(worker)
    worker.set_defaults(handler=_worker)

    from worker.agent.main import add_launch_arguments

    launch = sub.add_parser(
        "launch",
        help="run one placement of an attempt and exit (what an engine such as Slurm starts on each node)",
    )
    add_launch_arguments(launch)
    launch.set_defaults(handler=_launch)

    db = sub.add_parser("db", help="database administration")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_up = db_sub.add_parser("upgrade", help="apply the migrations up to the newest schema")
    db_up.set_defaults(handler=_db_upgrade)

    token = sub.add_parser("token", help="API tokens: create (database), list and revoke (API, admin token)")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    token_create = token_sub.add_parser(
        "create", help="create a token and print it once (writes to the database directly)"
    )
    token_create.add_argument("--role", required=True, choices=["admin", "user", "worker"])
    token_create.add_argument("--name", required=True)
    token_create.set_defaults(handler=_token_create)
    commands.register_token_commands(token_sub)

    commands.register(sub)
    demo.register(sub)
    return parser


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
