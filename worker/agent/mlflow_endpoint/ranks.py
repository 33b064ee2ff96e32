"""Which rank calls: the ``RANK`` of the process at the other end of a loopback connection
(the ``per_node`` launch mode, where a node's ranks share one token)."""

from __future__ import annotations

import contextlib
from typing import Any

from worker.agent import peers, sandbox


def caller_rank(client: tuple[Any, ...], server: tuple[Any, ...]) -> int | None:
    """``RANK`` of the process at the client end of a loopback connection: a process of the
    agent's user or of the user the sandbox runs jobs as (None where there is none)."""
    uids: set[int] = set()
    with contextlib.suppress(ValueError):
        job_user = sandbox.run_user()
        if job_user is not None:
            uids.add(job_user[0])
    return peers.caller_rank(client, server, uids)
