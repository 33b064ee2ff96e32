"""``torchyard launch``: run exactly one placement of one attempt, then exit (docs/slurm.md).

What an engine (Slurm's ``srun``) starts on each node of an attempt's allocation, where
no resident agent runs. It authenticates with the attempt's launch token
(``TORCHYARD_LAUNCH_TOKEN``: scoped to that attempt, never a node's worker token nor the
admin's), checks in for its node rank (``SLURM_NODEID``; the first launcher to check in
binds every rank to the allocation's nodes, the rendezvous at node rank 0's address),
then runs the placement with the agent's own code (:class:`~worker.agent.placement.PlacementRun`:
datasets, torchrun or the script, reports, checkpoints, model, outputs), heartbeating its
lease, and exits when the placement has reported.

Signals: SIGTERM (Slurm's preemption, ``scancel``, or the end of the time limit) and
SIGUSR1 (``sbatch --signal=USR1@<grace>``: the time limit is near) make the ranks
checkpoint at their next step boundary and the placement report ``preempted``; the
service decides from Slurm's own account whether the job is requeued or was cancelled.
SIGINT stops at once.

It touches nothing but its own run: it kills no leftovers on the node (other jobs share it),
the GPUs are those the engine gave it (``CUDA_VISIBLE_DEVICES`` is kept) and the ranks'
threads are sized to the CPUs it gave (``TORCHYARD_LAUNCH_CPUS``, or Slurm's
``SLURM_CPUS_ON_NODE``).

Slurm signals every process of a job step, not only the launcher: torchrun and the ranks
are started shielded (:mod:`worker.agent.guard` ``--shield``: SIGTERM and SIGUSR1 ignored),
so a preemption reaches the ranks only as the launcher's checkpoint request and they stop
at a step boundary with a checkpoint instead of dying mid-step.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchyard.contract.errors import StaleLeaseError, TorchyardError
from torchyard.contract.protocol import ClaimedPlacement, LaunchCheckIn
from worker.agent import sandbox
from worker.agent.api import WorkerApi, retrying
from worker.agent.main import add_launch_arguments
from worker.agent.node import address_towards, detect_resources, interface_for
from worker.agent.placement import AgentContext, PlacementRun, apply_stop_orders
from worker.agent.watchdog import preempt_grace_s

log = logging.getLogger(__name__)

LAUNCH_TOKEN_ENV = "TORCHYARD_LAUNCH_TOKEN"
# How long the launcher keeps trying to check in while the API is unreachable.
CHECK_IN_PATIENCE_S = 300.0


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact node list (``n[1-3],gpu7``) as names, through ``scontrol show hostnames``."""
    if not any(c in nodelist for c in "[],"):
        return [nodelist] if nodelist else []
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
    )
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


# The CPUs an engine gave the placement (the Kubernetes engine sets it; Slurm has its own).
LAUNCH_CPUS_ENV = "TORCHYARD_LAUNCH_CPUS"


def allocated_cpus(usable: int, environ: Mapping[str, str] | None = None) -> int:
    """The CPUs the engine gave this node's share of the job (``TORCHYARD_LAUNCH_CPUS``, as
    the Kubernetes engine sets it from the pod's CPU request, else Slurm's
    ``SLURM_CPUS_ON_NODE``), at most ``usable`` (those this process may run on): the ranks'
    threads are sized to them, not to the whole node that other jobs share."""
    env = os.environ if environ is None else environ
    raw = (env.get(LAUNCH_CPUS_ENV) or env.get("SLURM_CPUS_ON_NODE") or "").strip()
    return max(1, min(usable, int(raw))) if raw.isdecimal() and int(raw) > 0 else usable


def _default_work_dir() -> Path:
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / f"torchyard-launch-{os.getuid()}"


class PlacementLauncher:
    """One placement: check in, run, heartbeat, report, exit."""

    def __init__(
        self,
        api: WorkerApi,
        attempt_id: str,
        *,
        node: str,
        node_rank: int,
        nodes: list[str],
        address: str,
        work_dir: Path,
        grace_s: float = 10.0,
    ) -> None:
        self.api = api
        self.attempt_id = attempt_id
        self.node = node
        self.node_rank = node_rank
        self.nodes = nodes
        self.address = address
        self.work_dir = work_dir
        self.grace_s = grace_s
        self.shutdown = threading.Event()
        self.placement: PlacementRun | None = None
        self.done = threading.Event()
        self._pending_preempt: str | None = None

    def check_in(self) -> ClaimedPlacement:
        body = LaunchCheckIn(node=self.node, node_rank=self.node_rank, nodes=self.nodes, address=self.address)
        return retrying(
            lambda: self.api.check_in(self.attempt_id, body),
            f"checking in for attempt {self.attempt_id}",
            stop=self.shutdown,
            deadline=time.monotonic() + CHECK_IN_PATIENCE_S,
        )

    def run(self) -> int:
        """0 once the placement reported (whatever its outcome), 1 when it could not run or report."""
        try:
            work = self.check_in()
        except StaleLeaseError as exc:
            log.warning("nothing to run: %s", exc.message)
            return 0
        self.work_dir.mkdir(parents=True, exist_ok=True)
        resources = detect_resources(work.process_count_per_node)
        ctx = AgentContext(
            api=self.api,
            node_name=self.node,
            work_dir=self.work_dir,
            cpus=allocated_cpus(resources.cpus),
            grace_s=self.grace_s,
            socket_ifname=interface_for(self.address),
            release=lambda _run: self.done.set(),
            shutdown=self.shutdown,
            sandbox=sandbox.mode(),
            heartbeat_interval_s=work.heartbeat_interval_s or 2.0,
            lease_timeout_s=work.lease_timeout_s or 15.0,
            shielded=True,
        )
        units = tuple(range(work.process_count_per_node))
        # On a GPU node the engine's allocation is what this process sees: one per local rank.
        gpu_ids = tuple(resources.gpu_ids[: work.process_count_per_node]) if resources.is_cuda else ()
        placement = self.placement = PlacementRun(ctx, work, units, gpu_ids=gpu_ids)
        log.info(
            "job %s attempt %d: node %s is node rank %d of %d (rendezvous %s:%d)",
            work.job_id,
            work.attempt_number,
            self.node,
            work.node_rank,
            work.node_count,
            work.master_addr,
            work.master_port,
        )
        if self._pending_preempt is not None:
            placement.request_preempt(self._pending_preempt)
        heart = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        placement.start()
        heart.start()
        placement.thread.join()
        self.shutdown.set()
        return 0 if placement.report.recorded else 1

    def preempt(self, why: str) -> None:
        """The engine asks this placement to stop (a signal): checkpoint, report preempted."""
        if self.placement is None:
            self._pending_preempt = why
            self.shutdown.set()  # still checking in: give up, nothing runs yet
            return
        self.placement.request_preempt(why)

    def _heartbeat_loop(self) -> None:
        assert self.placement is not None
        placement = self.placement
        while not self.done.is_set():
            interval = placement.ctx.heartbeat_interval_s
            try:
                answer = self.api.launch_heartbeat(
                    self.attempt_id, self.node, [placement.lease_token], timeout=max(5.0, 2 * interval)
                )
            except TorchyardError as exc:
                if exc.status_code == 401:  # the launch token was revoked: the attempt is over
                    placement.request_stop("stale", f"the launch token was refused: {exc.message}")
                else:
                    log.warning("heartbeat failed: %s", exc)
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)
            else:
                try:
                    apply_stop_orders(answer.stop, [placement])
                except Exception:  # the heartbeat must go on whatever happens
                    log.exception("applying stop orders failed")
            self.done.wait(interval)


def _identity(args: argparse.Namespace) -> tuple[str, int, list[str]]:
    node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    rank_text = args.node_rank if args.node_rank is not None else os.environ.get("SLURM_NODEID")
    if rank_text is None:
        raise SystemExit("error: no node rank: pass --node-rank or run under srun (SLURM_NODEID)")
    if args.nodes:
        nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    elif os.environ.get("SLURM_JOB_NODELIST"):
        nodes = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
    else:
        nodes = [node]
    return node, int(rank_text), nodes


def run(args: argparse.Namespace) -> int:
    from worker.agent.main import drop_secrets_from_environment, refuse_inspection, token_from_pipe

    logging.getLogger("httpx").setLevel(logging.WARNING)
    drop_secrets_from_environment(LAUNCH_TOKEN_ENV)
    refuse_inspection()
    token = token_from_pipe()
    if not token:
        log.error("no launch token: set %s", LAUNCH_TOKEN_ENV)
        return 2
    node, node_rank, nodes = _identity(args)
    api = WorkerApi(args.api, token)
    launcher = PlacementLauncher(
        api,
        args.attempt,
        node=node,
        node_rank=node_rank,
        nodes=nodes,
        address=args.address or address_towards(args.api),
        work_dir=(args.work_dir or _default_work_dir()).resolve(),
        grace_s=args.grace_period,
    )

    def _preempt(signum: int, _frame: Any) -> None:
        launcher.preempt(f"the engine sent {signal.Signals(signum).name} (preemption, time limit or cancel)")

    signal.signal(signal.SIGTERM, _preempt)
    signal.signal(signal.SIGUSR1, _preempt)
    signal.signal(signal.SIGINT, lambda *_: launcher.shutdown.set())
    log.info(
        "launcher for attempt %s on node %s (rank %d of %s), preemption grace %.0f s",
        args.attempt,
        node,
        node_rank,
        ",".join(nodes),
        preempt_grace_s(),
    )
    try:
        return launcher.run()
    finally:
        api.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker.agent.placement_launcher", description="torchyard one-placement launcher"
    )
    add_launch_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(args)
    except TorchyardError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
