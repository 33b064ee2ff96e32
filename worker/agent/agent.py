"""The worker agent: one per node. Registers, heartbeats, claims work, runs it.

Three kinds of threads:

* the heartbeat thread renews the node and the leases of its placements every
  ``heartbeat_interval_s`` and passes stop orders (cancel, failure elsewhere, stale
  lease) to the placements concerned;
* the claim loop long-polls the API for work, back to back (no sleep between polls;
  a backoff only after errors), and starts a placement thread per claim;
* one thread per placement (see :mod:`worker.agent.placement`).

The API may be unreachable for a while (restarted, upgraded, its database down): every
call is retried with backoff, the ranks train on, and what they write waits in the run
directory until the API is back (see :mod:`worker.agent.reporting`). A
placement whose lease the API no longer knows (409 or a ``stale`` stop order) has
its ranks killed. SIGTERM drains the node: no more claims, every placement is
preempted (its ranks checkpoint at their next step boundary, the checkpoint is
uploaded, the placement reports ``preempted``), then the agent exits; a
``preempted`` stop order does the same for one placement. SIGINT stops at once. Two answers end the agent instead: its token refused (401: revoked),
or its node held by another agent (409 ``NodeNameInUseError``, see
:mod:`worker.agent.identity`).
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchyard.contract.errors import AuthenticationError, NodeNameInUseError, NotFoundError, TorchyardError
from torchyard.contract.protocol import ClaimedPlacement, HeartbeatResponse, StopOrder
from worker.agent import sandbox, weights_cache
from worker.agent.api import Backoff, WorkerApi, is_retryable, retrying
from worker.agent.identity import NodeLock, load_or_create_agent_key
from worker.agent.marked_processes import kill_leftovers
from worker.agent.node import NodeResources, address_towards, detect_resources, interface_for
from worker.agent.placement import AgentContext, PlacementRun, apply_stop_orders
from worker.agent.run_files import DEFAULT_LOG_BACKLOG_BYTES
from worker.agent.runs import DEFAULT_KEEP_RUNS, prune_runs, shed_results
from worker.agent.watchdog import preempt_grace_s

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 2.0
# The longest claim long-poll the agent asks for; the API hands out its own limit, which grows
# with the cluster (up to 55 s at 1,000 nodes).
MAX_CLAIM_WAIT_S = 60.0


@dataclass(frozen=True)
class AgentOptions:
    api_url: str
    token: str
    name: str
    address: str | None = None
    slots: int = 1
    force_cpu: bool = False
    work_dir: Path = Path("torchyard-worker")
    grace_s: float = 10.0
    keep_runs: int = DEFAULT_KEEP_RUNS
    log_backlog_bytes: int = DEFAULT_LOG_BACKLOG_BYTES
    # How long to wait for an earlier agent of this node still stopping (--wait-for-node).
    node_wait_s: float = 0.0


class UnitPool:
    """This node's processing units, handed to placements (GPU indexes on a CUDA node)."""

    def __init__(self, ids: list[int]) -> None:
        self._free = list(ids)
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[int, ...]:
        with self._lock:
            if n > len(self._free):
                # The API never over-commits a node; a mismatch means a run is still winding
                # down locally after the API gave up on it. Share rather than refuse.
                log.warning("%d unit(s) asked, %d free: sharing units", n, len(self._free))
                taken = tuple(self._free) + tuple(range(n - len(self._free)))
                self._free = []
                return taken
            taken, self._free = tuple(self._free[:n]), self._free[n:]
            return taken

    def give(self, ids: tuple[int, ...]) -> None:
        with self._lock:
            self._free = sorted(set(self._free) | set(ids))


class Agent:
    def __init__(self, options: AgentOptions, resources: NodeResources | None = None) -> None:
        self.options = options
        self.resources = resources or detect_resources(options.slots, force_cpu=options.force_cpu)
        self.address = options.address or address_towards(options.api_url)
        work_dir = options.work_dir.resolve()
        work_dir.mkdir(parents=True, exist_ok=True)
        self.node_lock = NodeLock(work_dir, options.name)
        self.api = WorkerApi(
            options.api_url, options.token, agent_key=load_or_create_agent_key(work_dir, options.name)
        )
        self.shutdown = threading.Event()
        # SIGTERM: drain the node, preempt every placement, then exit (a reclaimed spot node).
        self.draining = threading.Event()
        # Set once the node is registered: a SIGTERM before then has nothing to drain.
        self.registered = threading.Event()
        # Set when the API answers that this agent must go (token revoked, node taken).
        self.fatal: TorchyardError | None = None
        self.runs: dict[str, PlacementRun] = {}
        self._runs_lock = threading.Lock()
        self.units = UnitPool(list(self.resources.gpu_ids) or list(range(self.resources.units)))
        self.ctx = AgentContext(
            api=self.api,
            node_name=options.name,
            work_dir=work_dir,
            cpus=self.resources.cpus,
            grace_s=options.grace_s,
            socket_ifname=interface_for(self.address),
            release=self._release,
            shutdown=self.shutdown,
            draining=self.draining,
            log_backlog_bytes=options.log_backlog_bytes,
            sandbox=sandbox.mode(),
            node_units=self.resources.units,
        )
        self.claim_wait = MAX_CLAIM_WAIT_S

    # --- lifecycle -------------------------------------------------------------------------

    def register(self) -> None:
        info: dict[str, Any] = {
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "python": platform.python_version(),
            "cpus": self.resources.cpus,
            "gpus": len(self.resources.gpu_ids),
            "socket_ifname": self.ctx.socket_ifname,
            "sandbox": self.ctx.sandbox,
            weights_cache.HUB_INFO_KEY: weights_cache.hub_allowed(),
        }
        answer = retrying(
            lambda: self.api.register(
                self.options.name, self.address, self.resources.units, self.resources.accelerator, info
            ),
            f"registering node {self.options.name} at {self.options.api_url}",
            stop=self.shutdown,
        )
        self.ctx.heartbeat_interval_s = answer.heartbeat_interval_s or DEFAULT_HEARTBEAT_S
        self.ctx.lease_timeout_s = answer.lease_timeout_s or self.ctx.lease_timeout_s
        self.claim_wait = min(MAX_CLAIM_WAIT_S, answer.claim_poll_timeout_s or MAX_CLAIM_WAIT_S)
        log.info(
            "node %s registered: %d unit(s) of %s at %s (heartbeat %.1f s, lease %.1f s)",
            self.options.name,
            self.resources.units,
            self.resources.accelerator,
            self.address,
            self.ctx.heartbeat_interval_s,
            self.ctx.lease_timeout_s,
        )
        if self.ctx.sandbox == sandbox.UNAVAILABLE:
            log.warning(
                "no sandbox on this node (%s): script jobs are refused; install bubblewrap, or set %s=off",
                sandbox.unavailable_reason(),
                sandbox.SANDBOX_VAR,
            )
        elif self.ctx.sandbox == sandbox.OFF:
            log.warning("%s=off: runs are not sandboxed on this node", sandbox.SANDBOX_VAR)

    def run(self) -> int:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT when run in the main thread).

        Raises ``NodeNameInUseError`` when another agent holds the node (here or at the
        API), ``AuthenticationError`` when the API refuses the token.
        """
        self.node_lock.acquire(
            self.options.node_wait_s
        )  # before anything else: a second agent must not kill our ranks
        try:
            return self._serve()
        finally:
            self.api.close()
            self.node_lock.release()

    def _serve(self) -> int:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self._drain_requested())
            signal.signal(signal.SIGINT, lambda *_: self.shutdown.set())
        kill_leftovers(self.options.name, self.ctx.work_dir)
        # The agent never imports torch (seconds of CPU and ~1 GB): it finds GPUs through the
        # driver library and checks model folders by their manifest, so it registers well
        # under a second after it starts; only the ranks it launches load torch.
        try:
            self.register()  # retried while the API is unreachable
        except Exception:
            if self.shutdown.is_set():
                log.info("stopped before the node could register")
                return 0
            raise
        if self.shutdown.is_set():
            return 0
        self.registered.set()
        threads = [
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self._claim_loop, name="claim", daemon=True),
        ]
        for t in threads:
            t.start()
        self._wait_for_the_end()
        log.info("shutting down: stopping %d placement(s)", len(self.runs))
        for placement in self._active():
            placement.request_stop("shutdown", "the agent is shutting down")
        for placement in self._active():
            placement.thread.join(self.options.grace_s + 60)
        if self.fatal is not None:
            raise self.fatal
        log.info("agent stopped")
        return 0

    def stop(self) -> None:
        self.shutdown.set()

    def _wait_for_the_end(self) -> None:
        """Until shutdown, or SIGTERM (then drain and preempt first)."""
        while not self.shutdown.wait(0.5):
            if self.draining.is_set():
                self._drain_and_preempt()
                return

    def _drain_requested(self) -> None:
        # A signal handler: the main thread does the work.
        self.draining.set()
        if not self.registered.is_set():
            # Still registering (the API unreachable, say): nothing runs here yet, stop now.
            self.shutdown.set()

    def _drain_and_preempt(self) -> None:
        """SIGTERM: the node takes no new work; its placements checkpoint at their next
        step boundary, upload it and report ``preempted``; then the agent exits."""
        log.info(
            "SIGTERM: draining node %s and preempting %d placement(s)", self.options.name, len(self.runs)
        )
        try:
            self.api.drain(self.options.name)
        except NotFoundError:
            log.warning("the API has no drain route for nodes: preempting the placements anyway")
        except Exception as exc:
            log.warning("could not drain node %s at the API (%s): preempting anyway", self.options.name, exc)
        for placement in self._active():
            placement.request_preempt(f"the worker agent of node {self.options.name} got SIGTERM")
        for placement in self._active():
            placement.thread.join(preempt_grace_s() + self.options.grace_s + 90)
        log.info("every placement preempted")

    def _must_stop(self, exc: TorchyardError) -> None:
        """The API says this agent must go: stop its ranks and exit with ``exc``."""
        if self.fatal is None:
            self.fatal = exc
            log.error("stopping the agent: %s: %s", exc.code, exc.message)
        self.shutdown.set()

    # --- placements ------------------------------------------------------------------------

    def _active(self) -> list[PlacementRun]:
        with self._runs_lock:
            return list(self.runs.values())

    def _release(self, placement: PlacementRun) -> None:
        with self._runs_lock:
            self.runs.pop(placement.lease_token, None)
            active = [run.run_dir for run in self.runs.values()]
        self.units.give(placement.unit_ids)
        try:
            if placement.report.recorded:
                shed_results(placement.run_dir)
                shed_results(placement.agent_dir)
            prune_runs(self.ctx.runs_dir, self.options.keep_runs, active, self.ctx.placements_dir)
        except OSError:
            log.exception("pruning old run directories failed")

    def _start(self, work: ClaimedPlacement) -> None:
        units = self.units.take(work.process_count_per_node)
        # GPU indexes are handed to the ranks; CPU slots are only counted.
        placement = PlacementRun(self.ctx, work, units, gpu_ids=units if self.resources.is_cuda else ())
        with self._runs_lock:
            self.runs[placement.lease_token] = placement
        if self.shutdown.is_set():
            placement.request_stop("shutdown", "the agent is shutting down")
        elif self.draining.is_set():
            placement.request_preempt(f"node {self.options.name} is draining")
        placement.start()

    # --- loops -----------------------------------------------------------------------------

    def _claim_loop(self) -> None:
        backoff = Backoff()
        while not self.shutdown.is_set():
            if self.draining.is_set():
                self.shutdown.wait(1.0)
                continue
            try:
                work = self.api.claim(self.options.name, self.claim_wait)
            except (AuthenticationError, NodeNameInUseError) as exc:
                self._must_stop(exc)
                return
            except Exception as exc:
                if isinstance(exc, NotFoundError):
                    log.warning("the API does not know node %s: registering again", self.options.name)
                    self._reregister()
                    continue
                delay = backoff.next()
                level = logging.WARNING if is_retryable(exc) else logging.ERROR
                log.log(level, "claim failed (%s); retrying in %.1f s", exc, delay)
                self.shutdown.wait(delay)
                continue
            backoff.reset()
            if work is not None:
                log.info(
                    "claimed job %s (attempt %d, node rank %d)",
                    work.job_id,
                    work.attempt_number,
                    work.node_rank,
                )
                try:
                    self._start(work)
                except Exception:  # the lease runs out and the API fails the job
                    log.exception("could not start job %s", work.job_id)

    def _heartbeat_loop(self) -> None:
        # The registration was the node's sign of life: the first heartbeat is due an interval
        # later (a cluster whose agents all start together sends one request each, not two).
        while not self.shutdown.wait(self.ctx.heartbeat_interval_s):
            interval = self.ctx.heartbeat_interval_s
            active = self._active()
            try:
                answer = self.api.heartbeat(
                    self.options.name, [p.lease_token for p in active], timeout=max(5.0, 2 * interval)
                )
            except NotFoundError:
                log.warning("the API does not know node %s: registering again", self.options.name)
                self._reregister()
                continue
            except (AuthenticationError, NodeNameInUseError) as exc:
                self._must_stop(exc)
                return
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)
            else:
                self._follow_timing(answer)
                try:
                    self._apply_stop_orders(answer.stop, active)
                except Exception:  # the heartbeat must go on whatever happens
                    log.exception("applying stop orders failed")

    def _follow_timing(self, answer: HeartbeatResponse) -> None:
        """The API hands out the heartbeat interval, lease and claim wait in every answer: they
        grow with the cluster's size (an agent registered while it was small slows down now)."""
        interval, lease = answer.heartbeat_interval_s, answer.lease_timeout_s
        if interval > 0 and interval != self.ctx.heartbeat_interval_s:
            log.info("heartbeat every %.1f s from now on (lease %s s)", interval, lease)
            self.ctx.heartbeat_interval_s = float(interval)
        if lease > 0:
            self.ctx.lease_timeout_s = float(lease)
        claim_wait = answer.claim_poll_timeout_s
        if claim_wait is not None and claim_wait > 0:
            self.claim_wait = min(MAX_CLAIM_WAIT_S, float(claim_wait))

    def _apply_stop_orders(self, orders: list[StopOrder], active: list[PlacementRun]) -> None:
        apply_stop_orders(orders, active)

    def _reregister(self) -> None:
        try:
            self.register()
        except (AuthenticationError, NodeNameInUseError) as exc:
            self._must_stop(exc)
        except TorchyardError as exc:
            log.error("registering again failed: %s", exc)
            self.shutdown.wait(5)
