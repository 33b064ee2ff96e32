"""A private, real Slurm 22.05 cluster for the tests: Debian's ``slurmctld``, ``slurmd`` and ``munge``.

Layout (root needed, as for :mod:`tests.support.netns`)::

    root ns:   munged (private socket and key), slurmctld   at the gateway address
    node ns i: slurmd -N n<i>                               at the host's address

Each ``slurmd`` runs in its host's network namespace, entered with ``nsenter --net``
plus ``unshare --uts --mount`` so that it gets a host name of its own and a private
``/etc/hosts`` and ``/etc/resolv.conf`` (a resolver that fails at once: nothing here
may wait on DNS). ``ip netns exec`` is not used: it remounts ``/sys``, and slurmd 22.05
then exits. Each node has 4 CPUs and two fake GPUs (gres on character devices, so
Slurm sets ``CUDA_VISIBLE_DEVICES`` as on a real GPU node; nothing uses them as GPUs).

Two partitions over the same nodes: ``low`` (the default, preemptable with
``PreemptMode=CANCEL`` and a short ``GraceTime``) and ``high`` (a higher
``PriorityTier``): a ``high`` job that needs ``low``'s nodes preempts it. The builtin
scheduler (no backfill) keeps pending reasons predictable: the first pending job waits
for ``Resources``, those behind it for ``Priority``. ``SlurmdTimeout`` and ``KillWait``
are short so that a node cut off is ``DOWN`` within seconds.

Every daemon is started here, runs in the foreground, and is stopped by its pid;
the namespaces are deleted at :meth:`SlurmCluster.close`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from service.engines.slurm_cli import ENDED_STATES
from tests.conftest import free_ports, log_tails
from tests.support.netns import NetnsCluster, netns_unavailable

REQUIRE_ENV = "TORCHYARD_REQUIRE_SLURM"
COMMANDS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sinfo",
    "sbatch",
    "squeue",
    "scontrol",
    "scancel",
    "srun",
    "nsenter",
)
GRACE_S = 30  # the low partition's GraceTime: SIGTERM at preemption, SIGKILL this much later
CPUS_PER_NODE = 4
GPUS_PER_NODE = 2


@functools.lru_cache(maxsize=1)
def slurm_unavailable() -> str | None:
    """Why a private Slurm cluster cannot be brought up here, or None if it can."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing; "
            "apt-get install slurmctld slurmd slurm-client munge)"
        )
    why = netns_unavailable()
    if why is not None:
        return why
    return None


def require_slurm() -> None:
    """Skip where Slurm cannot run; fail instead when ``TORCHYARD_REQUIRE_SLURM=1`` (CI)."""
    reason = slurm_unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires the Slurm tests to run")
    pytest.skip(f"{reason}; the Slurm tests need a private Slurm cluster ({REQUIRE_ENV}=1 makes this fail)")


@dataclass
class SlurmNode:
    name: str
    address: str
    netns: str
    process: subprocess.Popen[bytes] | None = None


@dataclass
class SlurmCluster:
    """``size`` Slurm nodes (``n1``…) in network namespaces, their controller at the gateway."""

    root: Path
    size: int = 2
    nodes: list[SlurmNode] = field(default_factory=list)
    net: NetnsCluster | None = None
    gateway: str = ""
    _munged: subprocess.Popen[bytes] | None = None
    _ctld: subprocess.Popen[bytes] | None = None

    # --- what tests use ------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's client commands need (``SLURM_CONF``)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def squeue(self, name: str | None = None) -> list[dict[str, str]]:
        """Slurm's queue (every state Slurm still remembers), optionally one job name's."""
        argv = ["squeue", "-h", "-t", "all", "-o", "%i|%j|%T|%r|%N|%P"]
        if name is not None:
            argv += ["-n", name]
        rows = []
        for line in self.command(*argv).splitlines():
            i, j, t, r, n, p = line.split("|", 5)
            rows.append({"id": i, "name": j, "state": t, "reason": r, "nodes": n, "partition": p})
        return rows

    def active(self, name_prefix: str = "") -> list[dict[str, str]]:
        """Jobs not finished (pending, running, completing...) whose name starts with ``name_prefix``."""
        return [
            r for r in self.squeue() if r["state"] not in ENDED_STATES and r["name"].startswith(name_prefix)
        ]

    def node(self, name: str) -> SlurmNode:
        return next(n for n in self.nodes if n.name == name)

    def link(self, name: str, up: bool) -> None:
        """Cut a node off the network (its link down), or bring it back."""
        node = self.node(name)
        subprocess.run(
            ["ip", "-n", node.netns, "link", "set", "eth0", "up" if up else "down"], check=True, timeout=30
        )

    def resume(self, name: str) -> None:
        """A node Slurm marked DOWN is back in service (after its link came back)."""
        self.command("scontrol", "update", f"nodename={name}", "state=resume", check=False)

    def wait_nodes_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = self.command("sinfo", "-h", "-N", "-o", "%N|%t", check=False)
            states = dict(line.split("|", 1) for line in out.split() if "|" in line)
            if len(states) == self.size and all(s in ("idle", "mix", "alloc") for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not up within {timeout:.0f} s: {states}\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        return log_tails(self.root)

    # --- bring-up ------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.net = NetnsCluster(self.size).__enter__()
        self.gateway = self.net.gateway
        for i, host in enumerate(self.net.hosts, start=1):
            self.nodes.append(SlurmNode(name=f"n{i}", address=host.address, netns=host.netns))
        self._write_files()
        key = self.root / "munge.key"
        self._munged = subprocess.Popen(
            [
                "munged", "-F", "--force",
                f"--socket={self.root / 'munge.sock'}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munged.seed'}",
            ],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._wait_for(lambda: (self.root / "munge.sock").exists(), "munged's socket")
        log = open(self.root / "slurmctld.out", "wb")  # noqa: SIM115 - closed with the process
        self._ctld = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        self._wait_for(self._ctld_answers, "slurmctld")
        for node in self.nodes:
            node.process = self._start_slurmd(node)
        self.wait_nodes_idle()

    def _ctld_answers(self) -> bool:
        assert self._ctld is not None
        if self._ctld.poll() is not None:
            raise RuntimeError(f"slurmctld exited ({self._ctld.returncode}):\n{self.logs()}")
        return (
            subprocess.run(["scontrol", "ping"], env=self.env, capture_output=True, timeout=10).returncode
            == 0
        )

    def _start_slurmd(self, node: SlurmNode) -> subprocess.Popen[bytes]:
        hosts = self.root / f"hosts-{node.name}"
        resolv = self.root / "resolv.conf"
        script = (
            f"mount --bind {hosts} /etc/hosts && mount --bind {resolv} /etc/resolv.conf && "
            f"hostname {node.name} && exec slurmd -D -N {node.name} -f {self.conf}"
        )
        log = open(self.root / f"slurmd-{node.name}.out", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{node.netns}", "unshare", "--uts", "--mount", "--propagation",
             "private", "sh", "-c", script],
            env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        return proc

    def _wait_for(self, ready: Any, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up within {timeout:.0f} s:\n{self.logs()}")
            time.sleep(0.05)

    def _write_files(self) -> None:
        root = self.root
        (root / "state").mkdir(exist_ok=True)
        for node in self.nodes:
            (root / f"spool-{node.name}").mkdir(exist_ok=True)
        (root / "munge.key").write_bytes(os.urandom(1024))
        (root / "munge.key").chmod(0o400)
        for i in range(GPUS_PER_NODE):
            dev = root / f"gpu{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a character device (as /dev/null)
        ctld_port, slurmd_port = free_ports(2, "")
        me = socket.gethostname().split(".")[0]
        node_lines = "\n".join(
            f"NodeName={n.name} NodeAddr={n.address} CPUs={CPUS_PER_NODE} Gres=gpu:{GPUS_PER_NODE} "
            "RealMemory=2000 State=UNKNOWN"
            for n in self.nodes
        )
        names = ",".join(n.name for n in self.nodes)
        self.conf.write_text(
            f"""ClusterName=torchyardtest
SlurmctldHost={me}({self.gateway})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root / "munge.sock"}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=5
SlurmctldTimeout=10
MessageTimeout=3
KillWait=2
MinJobAge=600
InactiveLimit=0
Waittime=0
TreeWidth=50
{node_lines}
PartitionName=low Nodes={names} Default=YES PriorityTier=1 PreemptMode=CANCEL GraceTime={GRACE_S} MaxTime=INFINITE State=UP
PartitionName=high Nodes={names} PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP
""",
            encoding="utf-8",
        )
        (root / "gres.conf").write_text(
            f"NodeName={names} Name=gpu File={root}/gpu[0-{GPUS_PER_NODE - 1}]\n", encoding="utf-8"
        )
        (root / "resolv.conf").write_text(
            "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n", encoding="utf-8"
        )
        base = f"127.0.0.1 localhost\n{self.gateway} {me}\n" + "".join(
            f"{n.address} {n.name}\n" for n in self.nodes
        )
        for node in self.nodes:
            (root / f"hosts-{node.name}").write_text(base, encoding="utf-8")

    # --- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every daemon by its pid, then delete the namespaces. Never raises."""
        for node in self.nodes:
            _stop(node.process, group=True)
        _stop(self._ctld)
        _stop(self._munged)
        if self.net is not None:
            self.net.close()  # kills whatever is left in the namespaces (job steps), deletes them
            self.net = None


def _stop(proc: subprocess.Popen[bytes] | None, *, group: bool = False, timeout: float = 3.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)


@contextlib.contextmanager
def slurm_cluster(root: Path, size: int = 2) -> Iterator[SlurmCluster]:
    """A running :class:`SlurmCluster`, stopped on exit."""
    cluster = SlurmCluster(root=root, size=size).start()
    try:
        yield cluster
    finally:
        cluster.close()


def node_env(cluster: SlurmCluster, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = cluster.env
    if extra:
        env.update(extra)
    return env
