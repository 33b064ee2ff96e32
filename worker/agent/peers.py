"""Who is at the other end of a loopback TCP connection: its process, and that process's
``RANK`` (the variable torchrun gives each rank).

Standard library only: the MLflow endpoint uses it on the node's loopback, and the relay
inside a run without network (:mod:`worker.agent.net_relay`) on the run's own.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterable
from typing import Any

MAX_RANK = 1 << 20


def _proc_net_address(host: str, port: int) -> str:
    """An IPv4 address as ``/proc/net/tcp`` prints it (the address in the machine's byte order)."""
    (number,) = struct.unpack("=I", socket.inet_aton(host))
    return f"{number:08X}:{port:04X}"


def socket_owner(client: tuple[Any, ...], server: tuple[Any, ...], uids: Iterable[int] = ()) -> int | None:
    """The pid of a process of one of ``uids`` (this process's user by default) holding the
    client end of a loopback TCP connection, seen in this network namespace."""
    local, remote = _proc_net_address(client[0], client[1]), _proc_net_address(server[0], server[1])
    inode = None
    with contextlib.suppress(OSError), open("/proc/net/tcp") as table:
        for line in table:
            fields = line.split()
            if len(fields) > 9 and fields[1] == local and fields[2] == remote:
                inode = fields[9]
                break
    if inode is None or inode == "0":
        return None
    wanted, allowed = f"socket:[{inode}]", {os.getuid(), *uids}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_uid not in allowed:
                continue
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) == wanted:
                        return int(entry.name)
    return None


def rank_of(pid: int) -> int | None:
    """``RANK`` in the environment of process ``pid`` (None where unreadable or absent)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(b"RANK="):
            value = item[5:].decode(errors="replace")
            if value.isascii() and value.isdigit() and int(value) < MAX_RANK:
                return int(value)
            return None
    return None


def caller_rank(client: tuple[Any, ...], server: tuple[Any, ...], uids: Iterable[int] = ()) -> int | None:
    """``RANK`` of the process at the client end of a loopback connection (None where there is
    no such process of ``uids``, or no rank in its environment)."""
    pid = socket_owner(client, server, uids)
    return None if pid is None else rank_of(pid)
