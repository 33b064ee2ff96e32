"""``python -I net_relay.py SOCKET PORT -- COMMAND...``: the MLflow endpoint inside a run
that has no network (``environment.network: none``).

Such a run has a network namespace of its own with only a loopback interface, where the
agent's MLflow endpoint (on the node's loopback) cannot be reached. The agent binds a Unix
socket of its own into the sandbox (:class:`worker.agent.net_bridge.Bridge`); this program,
started in the sandbox as the run's user, listens on ``127.0.0.1:PORT`` of the run's own
loopback (the port of ``MLFLOW_TRACKING_URI``), relays every connection to that socket, and
``exec``s COMMAND, leaving the relay in a child process that ends with the sandbox.

Each relayed connection starts with one line, ``rank <RANK>`` or ``rank -``: the ``RANK``
of the process that connected (found from its socket in this network's ``/proc/net/tcp``),
which the endpoint gives the points of a ``per_node`` command's ranks, as it finds them
itself on the node's loopback.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys
import threading

from worker.agent.peers import caller_rank

# Connections relayed at once (the endpoint serves 32 at most; more wait here).
MAX_RELAYED = 64
_CHUNK = 64 * 1024


def pump(a: socket.socket, b: socket.socket, idle_s: float | None = None) -> None:
    """Copy bytes both ways between ``a`` and ``b`` until either side ends (or, with
    ``idle_s``, nothing moved for that long)."""
    with selectors.DefaultSelector() as sel:
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        while True:
            ready = sel.select(idle_s)
            if not ready:
                return
            for key, _ in ready:
                source = key.fileobj
                assert isinstance(source, socket.socket)
                try:
                    data = source.recv(_CHUNK)
                except OSError:
                    return
                if not data:
                    return
                try:
                    key.data.sendall(data)
                except OSError:
                    return


def _relay(client: socket.socket, address: tuple[str, int], listening: tuple[str, int], path: str) -> None:
    with client, contextlib.suppress(OSError):
        rank = caller_rank(address, listening)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with upstream:
            upstream.connect(path)
            upstream.sendall(f"rank {'-' if rank is None else rank}\n".encode())
            pump(client, upstream)


def serve(listener: socket.socket, path: str) -> None:
    slots = threading.BoundedSemaphore(MAX_RELAYED)
    listening = listener.getsockname()

    def run(client: socket.socket, address: tuple[str, int]) -> None:
        try:
            _relay(client, address, listening, path)
        finally:
            slots.release()

    while True:
        slots.acquire()
        client, address = listener.accept()
        threading.Thread(target=run, args=(client, address), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        print("usage: net_relay.py SOCKET PORT -- COMMAND...", file=sys.stderr)
        return 2
    path, port, command = argv[0], int(argv[1]), argv[3:]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    if os.fork() == 0:  # the relay; the sandbox ends it with the command
        try:
            serve(listener, path)
        finally:
            os._exit(0)
    listener.close()
    os.execvp(command[0], command)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
