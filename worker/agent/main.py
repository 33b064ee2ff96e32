"""``torchyard worker``: the command line of the worker agent."""

from __future__ import annotations

import argparse
import ctypes
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
# Where a re-executed agent reads its token from (a pipe's descriptor; see below).
TOKEN_FD_ENV = "TORCHYARD_TOKEN_FD"
# Variables the agent's own environment must not hold while it runs scripts.
SECRET_ENVS = ("TORCHYARD_TOKEN", "TORCHYARD_LAUNCH_TOKEN", "TORCHYARD_DATABASE_URL")
_MAX_TOKEN_BYTES = 4096
_PR_SET_DUMPABLE = 4


def drop_secrets_from_environment(token_env: str = TOKEN_ENV) -> None:
    """Start the agent again without its secrets in its environment (the token through a pipe).

    ``os.environ.pop`` changes only the interpreter's copy: the kernel keeps the environment
    a process started with, and ``/proc/<pid>/environ`` shows it to every process of the
    same user, the scripts the agent runs included. So an agent that finds a secret there
    ``exec``s itself (same pid, same arguments) with an environment that lacks it, the token
    (of ``token_env``: the worker token, or a launcher's launch token) written to a pipe it
    inherits. Returns only when there is nothing to drop.
    """
    if not any(name in os.environ for name in SECRET_ENVS) or not sys.orig_argv:
        return
    token = os.environ.get(token_env, "").strip().encode()
    if len(token) > _MAX_TOKEN_BYTES:  # more than a pipe holds unread; no token is that long
        raise SystemExit(f"error: ${token_env} is longer than {_MAX_TOKEN_BYTES} bytes")
    read_end, write_end = os.pipe()
    os.write(write_end, token)
    os.close(write_end)
    os.set_inheritable(read_end, True)
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENVS}
    env[TOKEN_FD_ENV] = str(read_end)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def token_from_pipe() -> str:
    """The token a re-executed agent was handed (empty when it was not re-executed)."""
    fd = os.environ.pop(TOKEN_FD_ENV, "")
    if not fd.isdigit():
        return ""
    try:
        with os.fdopen(int(fd), "rb") as pipe:
            return pipe.read(_MAX_TOKEN_BYTES + 1).decode(errors="replace").strip()
    except OSError:  # not a descriptor this process was handed
        return ""


def refuse_inspection() -> None:
    """Make the agent non-dumpable: processes of the same user (its scripts) can no longer
    read its memory or ``/proc/<pid>/environ`` nor attach a debugger (root still can), and
    it writes no core dump. Children it ``exec``s are not affected."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_DUMPABLE, 0) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


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
        "--wait-for-node",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for an earlier agent of this node and work directory that is still "
        "stopping (a quick restart) instead of refusing at once (default 0)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)",
    )


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """``torchyard launch``'s options (the one-placement launcher, :mod:`worker.agent.placement_launcher`)."""
    parser.add_argument("--api", required=True, help="URL of the API service as this node reaches it")
    parser.add_argument("--attempt", required=True, help="the attempt's id (its launch token must match)")
    parser.add_argument(
        "--node", default=None, help="this node's name (default: $SLURMD_NODENAME, else the host name)"
    )
    parser.add_argument(
        "--node-rank", type=int, default=None, help="this node's rank (default: $SLURM_NODEID)"
    )
    parser.add_argument(
        "--nodes",
        default=None,
        help="the allocation's nodes in node-rank order, comma-separated (default: $SLURM_JOB_NODELIST expanded)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="address other nodes reach this one at (default: the one facing the API)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="datasets cache and run directory (default: $TMPDIR/torchyard-launch-<uid>)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks",
    )


def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM/SIGINT."""
    from worker.agent.agent import Agent, AgentOptions

    # One line per heartbeat and claim would drown the agent's own messages.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    drop_secrets_from_environment()
    refuse_inspection()
    piped = token_from_pipe()
    token = args.token or piped
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
        node_wait_s=max(0.0, args.wait_for_node),
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
