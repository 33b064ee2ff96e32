"""The separate-hosts harness itself: hosts reach the API and each other by address, never by loopback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from service.config import Settings
from tests.conftest import LiveServer, free_port
from tests.support import netns
from tests.support.netns import netns_cluster, netns_names, require_netns

# Run inside a host: print what a TCP connect to each "addr:port" argument gives.
PROBE = textwrap.dedent(
    """
    import socket, sys
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
            print(target, "open")
        except OSError as exc:
            print(target, type(exc).__name__)
    """
)

# Run inside a host: listen on every address of the host, say so, and serve until killed.
LISTEN = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen()
    print("listening", flush=True)
    while True:
        s.accept()[0].close()
    """
)

HEALTH = textwrap.dedent(
    """
    import sys, urllib.request
    with urllib.request.urlopen(sys.argv[1] + "/healthz", timeout=10) as r:
        print(r.status, r.read().decode())
    """
)


def test_hosts_reach_the_api_and_each_other_but_not_each_others_loopback(tmp_path: Path) -> None:
    require_netns()
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    port = free_port()
    with netns_cluster(2) as cluster:
        a, b = cluster.hosts
        assert a.address != b.address != cluster.gateway
        server = LiveServer(settings, host=cluster.gateway).start()
        try:
            env = {"PATH": "/usr/bin:/bin", "NO_PROXY": "*"}
            health = cluster.run(
                a, [sys.executable, "-c", HEALTH, server.url], capture_output=True, text=True, env=env
            )
            assert health.returncode == 0, health.stderr
            assert health.stdout.strip() == '200 {"status":"ok"}'

            listener = cluster.popen(
                b, [sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True
            )
            assert listener.stdout is not None
            assert listener.stdout.readline().strip() == "listening"
            probe = cluster.run(
                a,
                [sys.executable, "-c", PROBE, f"{b.address}:{port}", f"127.0.0.1:{port}"],
                capture_output=True,
                text=True,
            )
            assert probe.stdout.splitlines() == [
                f"{b.address}:{port} open",
                f"127.0.0.1:{port} ConnectionRefusedError",
            ], probe.stderr
            # The host's own view: its loopback is its own, and the root namespace's is not shared.
            inside = cluster.run(
                b, [sys.executable, "-c", PROBE, f"127.0.0.1:{port}"], capture_output=True, text=True
            )
            assert inside.stdout.split() == [f"127.0.0.1:{port}", "open"]
            root = subprocess.run(
                [sys.executable, "-c", PROBE, f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=30
            )
            assert root.stdout.split() == [f"127.0.0.1:{port}", "ConnectionRefusedError"]
        finally:
            server.stop()
        names = [h.netns for h in cluster.hosts] + [cluster.hub]
    # Everything is gone afterwards, including the listener that was still running.
    assert not set(names) & set(netns_names())
    assert listener.poll() is not None


def test_cleanup_runs_when_the_test_body_fails() -> None:
    require_netns()
    with pytest.raises(RuntimeError, match="boom"), netns_cluster(1) as cluster:
        made = [cluster.hub, cluster.hosts[0].netns]
        raise RuntimeError("boom")
    assert not set(made) & set(netns_names())


def test_missing_namespaces_skip_or_fail_as_ci_requires(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "netns_unavailable", lambda: "creating network namespaces needs root")
    monkeypatch.delenv(netns.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        netns.require_netns()
    monkeypatch.setenv(netns.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="TORCHYARD_REQUIRE_NETNS=1"):
        netns.require_netns()
