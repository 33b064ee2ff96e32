"""``python -m worker.agent``: the worker agent (same as ``torchyard worker``)."""

from __future__ import annotations

import sys

from worker.agent.main import main

if __name__ == "__main__":
    sys.exit(main())
