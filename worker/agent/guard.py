"""``python -m worker.agent.guard PARENT_PID COMMAND...``: run COMMAND, tied to the agent's life.

The agent starts torchrun through this wrapper. It asks the kernel to send it SIGTERM
when its parent (the agent's launching thread) dies, then ``exec``s COMMAND, which keeps
that setting. So a SIGKILLed agent takes its torchrun with it, and torchrun, on SIGTERM,
stops its ranks: nothing trains on for an agent that no longer exists.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m worker.agent.guard PARENT_PID COMMAND...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:
        return 1  # the agent died before the setting took hold
    os.execvp(argv[1], argv[1:])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
