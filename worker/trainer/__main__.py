"""``python -m worker.trainer --config RUN_DIR/job.json`` (one rank, started by torchrun)."""

from __future__ import annotations

import logging
import os
import sys

from worker.trainer.cli import main

if __name__ == "__main__":
    status = main()
    if status != 0:
        # Exit without running finalizers: a destructor waiting on a dead peer (process group,
        # loader workers) must not keep this rank alive after its failure is recorded.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(0)
