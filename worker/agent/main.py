"""``torchyard worker``: the command line of the worker agent."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from torchyard.contract.errors import TorchyardError
from worker.agent.run_files import DEFAULT_LOG_BACKLOG_BYTES
from worker.agent.runs import DEFAULT_KEEP_RUNS

log = logging.getLogger(__name__)

TOKEN_ENV = "TORCHYARD_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", required=True, help="URL of the API service, e.g. http://10.0.0.1:8000")
    parser.add_argument(
        "--token",
        default=None,
        help=f"worker token (default: ${TOKEN_ENV}; prefer the variable, a command line shows in ps)",
    )
    parser.add_argument("--name", default=None, help="node name (default: the host name)")
    parser.add_argument(
        "--slots",
        type=int,
        default=1,
        help="processing units of a node without GPUs: CPU slots (default 1)",
    )
    parser.add_argument("--cpu", action="store_true", help="use CPU slots even where GPUs are visible")
    parser.add_argument(
        "--address",
        default=None,
        help="address other nodes reach this one at (default: the local address facing the API)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("torchyard-worker"),
        help="datasets cache and run directories (default ./torchyard-worker)",
    )
    parser.add_argument(
        "--keep-runs",
        type=int,
        default=DEFAULT_KEEP_RUNS,
        help=f"finished run directories (checkpoints, logs) kept on this node; older ones are "
        f"removed (default {DEFAULT_KEEP_RUNS})",
    )
    parser.add_argument(
        "--log-backlog-mb",
        type=float,
        default=DEFAULT_LOG_BACKLOG_BYTES / (1 << 20),
        help="unsent log MiB kept per stream while the API is unreachable; beyond that the oldest "
        f"are dropped, with a note (default {DEFAULT_LOG_BACKLOG_BYTES >> 20}; metric points are all kept)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM/SIGINT."""
    from worker.agent.agent import Agent, AgentOptions

    # One line per heartbeat and claim would drown the agent's own messages.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    token = args.token or os.environ.get(TOKEN_ENV, "").strip()
    # Nothing the agent starts (torchrun, ranks, anything) inherits the worker token.
    os.environ.pop(TOKEN_ENV, None)
    if not token:
        log.error("no worker token: pass --token or set %s", TOKEN_ENV)
        return 2
    if args.slots < 1:
        log.error("--slots must be at least 1")
        return 2
    if args.keep_runs < 0:
        log.error("--keep-runs must be 0 or more")
        return 2
    if not args.log_backlog_mb > 0:
        log.error("--log-backlog-mb must be more than 0")
        return 2
    name = args.name or socket.gethostname().split(".")[0] or "node"
    options = AgentOptions(
        api_url=args.api,
        token=token,
        name=name,
        address=args.address,
        slots=args.slots,
        force_cpu=args.cpu,
        work_dir=args.work_dir,
        grace_s=args.grace_period,
        keep_runs=args.keep_runs,
        log_backlog_bytes=max(1, int(args.log_backlog_mb * (1 << 20))),
    )
    return Agent(options).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.agent", description="torchyard worker agent")
    add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(args)
    except TorchyardError as exc:  # another agent holds the node, the token was refused...
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
