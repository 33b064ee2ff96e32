"""``python -m worker.agent.guard PARENT_PID COMMAND...``: run COMMAND, tied to the agent's life.

The agent starts torchrun through this wrapper. It asks the kernel to send it SIGTERM
when its parent (the agent's launching thread) dies, then ``exec``s COMMAND, which keeps
that setting. So a SIGKILLed agent takes its torchrun with it, and torchrun, on SIGTERM,
stops its ranks: nothing trains on for an agent that no longer exists.

``--shield`` (the one-placement launcher under an engine such as Slurm, which signals every
process of the job, not only the launcher): COMMAND and everything it starts ignore SIGTERM
and SIGUSR1 (a preemption, ``scancel``, the time limit's warning), which the launcher
turns into a checkpoint request instead; the parent's death sends SIGINT, and the launcher
stops the run with SIGINT too (then SIGKILL).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
SHIELD = "--shield"
# What an engine sends every process of its job; the launcher alone acts on them.
SHIELDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def main(argv: list[str]) -> int:
    shield = bool(argv) and argv[0] == SHIELD
    if shield:
        argv = argv[1:]
    if len(argv) < 2 or not argv[0].isdigit():
        print(f"usage: python -m worker.agent.guard [{SHIELD}] PARENT_PID COMMAND...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    if shield:
        for sig in SHIELDED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # kept across exec, and by every child
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGINT if shield else signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:
        return 1  # the agent died before the setting took hold
    os.execvp(argv[1], argv[1:])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
