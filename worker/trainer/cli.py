"""Command line of the trainer: ``python -m worker.trainer --config RUN_DIR/job.json``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from torchyard.contract.errors import TorchyardError
from worker.trainer import distributed
from worker.trainer.config import load_job
from worker.trainer.control import enable_stack_dumps
from worker.trainer.distributed import read_env
from worker.trainer.evaluate import run_evaluation
from worker.trainer.failure import failure_record, write_failure
from worker.trainer.runner import run_job

log = logging.getLogger("worker.trainer")


class _RankHandler(logging.StreamHandler):
    """stdout handler with a rank prefix (torchrun keeps one log stream per rank)."""


def configure_logging(rank: int, level: int = logging.INFO) -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _RankHandler)]:
        root.removeHandler(handler)
    handler = _RankHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def _record_for_torchrun(exc: BaseException) -> None:
    """Also leave torchrun's own error file, so its summary (in the placement's log) names the root cause."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception as error:  # best effort: the failure file above is what the agent reads
        log.warning("cannot write torchrun's error file: %s", error)


def main(argv: list[str] | None = None) -> int:
    """Run one rank; return its exit status (0 on success, 1 after writing a failure file)."""
    parser = argparse.ArgumentParser(
        prog="python -m worker.trainer", description="torchyard trainer (one rank; started by torchrun)"
    )
    parser.add_argument("--config", required=True, type=Path, help="the job.json written by the worker agent")
    args = parser.parse_args(argv)
    env = read_env()
    configure_logging(env.rank)
    enable_stack_dumps()
    # Until job.json is read, failures go next to it (the agent writes it into the run directory).
    output_dir = args.config.parent
    try:
        job = load_job(args.config)
        output_dir = Path(job.output_dir)
        if job.evaluates:
            run_evaluation(job, env)
        else:
            run_job(job, env)
    except Exception as exc:
        record = failure_record(exc, rank=env.rank, local_rank=env.local_rank, node=env.node_name)
        # A torchyard error says what is wrong in its message, printed once: its traceback
        # (in the failure file) and torchrun's summary of it would print it again.
        expected = isinstance(exc, TorchyardError)
        log.error(
            "rank %d failed with %s: %s",
            env.rank,
            record.code,
            record.message,
            exc_info=None if expected else exc,
        )
        try:
            path = write_failure(output_dir, record)
            log.info("failure recorded in %s", path.name)
        except OSError as write_error:
            log.error("cannot write the failure file: %s", write_error)
        if not expected:
            _record_for_torchrun(exc)
        if env.world_size == 1:
            # With peers the group may hold a broken collective; the process exits hard instead.
            distributed.teardown()
        return 1
    distributed.teardown()
    return 0
