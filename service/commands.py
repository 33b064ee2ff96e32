"""The service's commands of ``torchyard``: ``serve``, ``db upgrade`` and ``token create``.

The ``torchyard`` command finds them through the ``torchyard.commands`` entry point of
this package (see :mod:`torchyard.cli`): the CLI imports no part of the service.
"""

from __future__ import annotations

import argparse
import logging

from torchyard.extras import require


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
    from service.serving import serve

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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``serve`` and ``db upgrade``."""
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

    db = sub.add_parser("db", help="database administration")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_up = db_sub.add_parser("upgrade", help="apply the migrations up to the newest schema")
    db_up.set_defaults(handler=_db_upgrade)


def register_token(token_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``token create`` (writes to the database directly)."""
    token_create = token_sub.add_parser(
        "create", help="create a token and print it once (writes to the database directly)"
    )
    token_create.add_argument("--role", required=True, choices=["admin", "user", "worker"])
    token_create.add_argument("--name", required=True)
    token_create.set_defaults(handler=_token_create)
