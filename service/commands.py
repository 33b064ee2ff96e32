"""The service's commands of ``torchyard``: ``serve``, ``db upgrade``, ``storage migrate`` and
``token create``.

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
            _row, plain = create_token(session, args.name, Role(args.role), args.user)
    finally:
        db.dispose()
    print(plain)
    return 0


def _storage_migrate(args: argparse.Namespace) -> int:
    require("storage migrate", "server")
    from service.config import Settings
    from service.db.engine import Database
    from service.db.migrate import upgrade
    from service.services.storage_migrate import migrate
    from service.storage import open_storage

    settings = Settings()
    target = Settings(storage_url=args.to).storage_url  # checked as TORCHYARD_STORAGE_URL is
    _quiet_migrations(args)
    upgrade(settings.sqlalchemy_url)
    storage = open_storage(target, settings.data_dir)
    db = Database(settings.sqlalchemy_url)
    try:
        report = migrate(db, settings, storage, progress=print)
    finally:
        db.dispose()
    print(
        f"{len(report.copied)} copied ({report.bytes_sent} bytes), {len(report.skipped)} already there, "
        f"{len(report.missing)} missing from the data directory, {len(report.failed)} failed"
    )
    if not report.complete:
        print("not complete: nothing was switched; run the same command again to go on")
        return 1
    print(
        f"every artifact is in {storage.description}. To serve from it: stop the service, run this "
        f"command once more (it copies what arrived meanwhile), then start it with "
        f"TORCHYARD_STORAGE_URL={target}"
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``serve``, ``db upgrade`` and ``storage migrate``."""
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

    storage = sub.add_parser("storage", help="artifact storage administration (docs/storage.md)")
    storage_sub = storage.add_subparsers(dest="storage_command", required=True)
    storage_migrate = storage_sub.add_parser(
        "migrate",
        help="copy the data directory's artifacts into an S3 bucket (verified, resumable)",
        description="Copy every artifact of the data directory (TORCHYARD_DATA_DIR and its database) "
        "into the bucket, each verified by its sha256; objects already there are skipped, so it can "
        "be run again to go on or to copy what is new. Nothing is switched until every artifact is "
        "there; the service serves from the bucket once started with TORCHYARD_STORAGE_URL. The "
        "bucket's endpoint, region and credentials come from the standard AWS settings.",
    )
    storage_migrate.add_argument("--to", required=True, metavar="s3://BUCKET/PREFIX", help="the object store")
    storage_migrate.set_defaults(handler=_storage_migrate)


def register_token(token_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``token create`` (writes to the database directly)."""
    token_create = token_sub.add_parser(
        "create", help="create a token and print it once (writes to the database directly)"
    )
    token_create.add_argument("--role", required=True, choices=["admin", "user", "worker"])
    token_create.add_argument("--name", required=True)
    token_create.add_argument(
        "--user",
        metavar="NAME",
        help="the user a user or admin token acts for (docs/teams.md; default: a new user of the token's name)",
    )
    token_create.set_defaults(handler=_token_create)
