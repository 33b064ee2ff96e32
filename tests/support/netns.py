"""Separate network hosts on one Linux machine, for tests that must not assume loopback.

:class:`NetnsCluster` makes N network namespaces ("hosts"), each with its own
``eth0`` and address on a private /24, plus an address in the root namespace (the
"gateway") where a test serves the API. Every host reaches the gateway and every
other host by address; none shares a loopback with another or with the test
process, so anything that quietly relies on 127.0.0.1 breaks here as it would
across real machines.

The layer-2 switch is a bridge inside a namespace of its own ("hub") rather than in
the root namespace: bridged frames pass the netfilter hooks of the namespace the
bridge lives in, and a root namespace with a restrictive firewall (a ``FORWARD``
policy of ``DROP``, as container engines install) would drop host-to-host traffic.
A fresh namespace has no rules::

    root ns: <prefix>r  10.77.K.1/24 ──┐
                                       ├─ hub ns: br0
    host 0 ns: eth0     10.77.K.2/24 ──┤
    host 1 ns: eth0     10.77.K.3/24 ──┘

Names carry the test process id (``tyard<pid>…``), so parallel runs do not collide,
and namespaces left behind by a run that died are removed by the next one. Cleanup
(processes started in the hosts, then namespaces and links) runs even when set-up or
the test fails.

Each host resolves names from files of its own (``/etc/netns/<namespace>/``, which ``ip netns
exec`` mounts over ``/etc``): the machine's ``/etc/hosts`` plus every host's and the gateway's
address, and a resolver that fails at once. The machine's own DNS server is not reachable
from a host (its queries would go out through the gateway unanswered), and a lookup that
waited for it took 10 s each (a rank's ``getnameinfo`` of its peer, the gloo rendezvous).

Needs root and iproute2. :func:`netns_unavailable` says why namespaces cannot be
made here; :func:`require_netns` turns that into a skip, or a failure when
``TORCHYARD_REQUIRE_NETNS=1`` (CI).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

PREFIX = "tyard"
REQUIRE_ENV = "TORCHYARD_REQUIRE_NETNS"
# Private /24s are taken from this range, one per cluster.
SUPERNET = ipaddress.IPv4Network("10.77.0.0/16")
HOST_IFNAME = "eth0"
# Where ``ip netns exec NS`` finds files to mount over /etc's (ip-netns(8)).
NETNS_ETC = Path("/etc/netns")
# Nothing listens on a host's own loopback: a DNS query fails at once.
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_names() -> list[str]:
    out = _ip("-o", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_pid(name: str) -> int | None:
    """The test process id encoded in one of our names (``tyard<pid>-…``), else None."""
    if not name.startswith(PREFIX):
        return None
    digits = name[len(PREFIX) :].split("-", 1)[0].rstrip("r")
    return int(digits) if digits.isdigit() else None


def remove_stale() -> None:
    """Remove namespaces and links of earlier test runs whose process is gone."""
    for name in netns_names():
        pid = _owner_pid(name)
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            _kill_netns_processes(name)
            _ip("netns", "delete", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    links = _ip("-o", "link", "show", check=False).stdout
    for line in links.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@", 1)[0]
        pid = _owner_pid(link)
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            _ip("link", "delete", link, check=False)


def _kill_netns_processes(netns: str, timeout: float = 10.0) -> None:
    """SIGKILL what runs inside one of our namespaces (it keeps the namespace alive), again
    until none is left: a process forked while the first list was read is killed too, and
    the call returns once every one of them has exited."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(w) for w in _ip("netns", "pids", netns, check=False).stdout.split() if w.isdigit()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> str | None:
    """Why separate network namespaces cannot be made on this machine, or None if they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces exist only on Linux"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
            _ip("-n", probe, "link", "add", "name", "br0", "type", "bridge")
            _ip("netns", "exec", probe, "true")
        finally:
            _ip("netns", "delete", probe, check=False)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create network namespaces here: {exc}"
    return None


def require_netns() -> None:
    """Skip the calling test where namespaces cannot be made; fail instead when CI requires them."""
    reason = netns_unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires network-namespace tests to run")
    pytest.skip(
        f"{reason}; the separate-hosts test needs Linux network namespaces ({REQUIRE_ENV}=1 makes this fail)"
    )


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUPERNET with no address yet in the root namespace, chosen by process id."""
    used: list[ipaddress.IPv4Network] = []
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            used.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
    subnets = list(SUPERNET.subnets(new_prefix=24))[1:]
    start = os.getpid() % len(subnets)
    for i in range(len(subnets)):
        candidate = subnets[(start + i) % len(subnets)]
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise NetnsError(f"no free /24 left in {SUPERNET}")


@dataclass
class Host:
    """One simulated machine: a network namespace with ``eth0`` at ``address``."""

    name: str
    netns: str
    address: str
    ifname: str = HOST_IFNAME

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class NetnsCluster:
    """N hosts on one private subnet, plus ``gateway`` (an address of the root namespace)."""

    size: int
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: list[Host] = field(default_factory=list)
    gateway: str = ""
    subnet: ipaddress.IPv4Network | None = None
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)
    _root_link: str | None = None

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def __enter__(self) -> NetnsCluster:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        remove_stale()
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        prefixlen = self.subnet.prefixlen
        self.gateway = str(addresses[0])
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("-n", self.hub, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        _ip("-n", self.hub, "link", "set", "lo", "up")
        # The root namespace's leg: a veth whose other end is a port of the bridge.
        self._root_link = f"{self.tag}r"
        _ip("link", "add", "name", self._root_link, "type", "veth", "peer", "name", "up0", "netns", self.hub)
        _ip("addr", "add", f"{self.gateway}/{prefixlen}", "dev", self._root_link)
        _ip("link", "set", self._root_link, "up")
        self._attach("up0")
        for i in range(self.size):
            host = Host(name=f"host{i}", netns=f"{self.tag}-h{i}", address=str(addresses[i + 1]))
            _ip("netns", "add", host.netns)
            self._made.append(host.netns)
            port = f"p{i}"
            _ip(
                *f"-n {self.hub} link add name {port} type veth peer name {host.ifname} netns {host.netns}".split()
            )
            self._attach(port)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{prefixlen}", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "route", "add", "default", "via", self.gateway)
            self.hosts.append(host)
        self._write_name_files()
        self._wait_for_links()

    def _write_name_files(self) -> None:
        """Each host's ``hosts`` and ``resolv.conf`` (the module's docstring)."""
        try:
            base = Path("/etc/hosts").read_text(encoding="utf-8")
        except OSError:
            base = "127.0.0.1 localhost\n"
        names = f"{self.gateway} {self.tag}-gateway\n" + "".join(
            f"{h.address} {self.tag}-{h.name}\n" for h in self.hosts
        )
        for host in self.hosts:
            folder = NETNS_ETC / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(base.rstrip("\n") + "\n" + names, encoding="utf-8")
            (folder / "resolv.conf").write_text(RESOLV_CONF, encoding="utf-8")

    def _attach(self, port: str) -> None:
        _ip("-n", self.hub, "link", "set", port, "master", "br0")
        _ip("-n", self.hub, "link", "set", port, "up")

    def _wait_for_links(self, timeout: float = 10.0) -> None:
        """Wait until every host's eth0 has carrier (a veth is up once both ends are)."""
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            while True:
                out = _ip("-n", host.netns, "-o", "link", "show", host.ifname).stdout
                if "LOWER_UP" in out:
                    break
                if time.monotonic() > deadline:
                    raise NetnsError(f"{host.netns}: {host.ifname} has no carrier: {out.strip()}")
                time.sleep(0.05)

    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``; the cluster kills it at cleanup if it still runs."""
        proc: subprocess.Popen[Any] = subprocess.Popen(host.argv(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside ``host`` to completion (``timeout`` defaults to 60 s)."""
        kwargs.setdefault("timeout", 60)
        return subprocess.run(host.argv(argv), **kwargs)

    def close(self) -> None:
        """Stop what runs in the hosts, then delete namespaces and links. Never raises."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                proc.wait(timeout=10)
        self._procs.clear()
        for netns in reversed(self._made):
            _kill_netns_processes(netns)
            _ip("netns", "delete", netns, check=False)
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        self._made.clear()
        if self._root_link is not None:
            # Normally gone with the hub namespace that held its peer.
            _ip("link", "delete", self._root_link, check=False)
            self._root_link = None
        self.hosts.clear()


@contextlib.contextmanager
def netns_cluster(size: int) -> Iterator[NetnsCluster]:
    """A :class:`NetnsCluster` of ``size`` hosts, torn down on exit."""
    with NetnsCluster(size) as cluster:
        yield cluster
