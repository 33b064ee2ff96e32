"""The worker's commands of ``torchyard``: ``worker`` (the resident node agent) and
``launch`` (one placement of an attempt, what an engine such as Slurm starts on a node).

The ``torchyard`` command finds them through the ``torchyard.commands`` entry point of
this package (see :mod:`torchyard.cli`): the CLI imports no part of the worker.
"""

from __future__ import annotations

import argparse

from torchyard.extras import require
from worker.agent.main import add_arguments, add_launch_arguments


def _worker(args: argparse.Namespace) -> int:
    require("worker", "worker")
    from worker.agent.main import run

    return run(args)


def _launch(args: argparse.Namespace) -> int:
    require("launch", "worker")
    from worker.agent.placement_launcher import run

    return run(args)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``worker`` and ``launch``."""
    worker = sub.add_parser("worker", help="run a worker agent on this node")
    add_arguments(worker)
    worker.set_defaults(handler=_worker)

    launch = sub.add_parser(
        "launch",
        help="run one placement of an attempt and exit (what an engine such as Slurm starts on each node)",
    )
    add_launch_arguments(launch)
    launch.set_defaults(handler=_launch)
