"""Seeds for every random generator, all derived from the job's ``random_seed``."""

from __future__ import annotations

import hashlib
import random
import signal

import numpy as np
import torch


def derive_seed(base: int, *parts: object) -> int:
    """A seed in ``[0, 2**62)`` derived from ``base`` and a purpose (``"init"``, epoch, rank...).

    Hashing keeps the streams of different purposes independent and accepts any 64-bit
    signed ``random_seed`` (numpy and torch need non-negative seeds).
    """
    text = ":".join(str(p) for p in (base, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy's global generator and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_loader_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: torch already seeds each worker from the loader's
    generator; give python ``random`` and numpy the same per-worker seed."""
    seed = torch.initial_seed() % 2**62
    random.seed(seed)
    np.random.seed(seed % 2**32)


def ignored_signals() -> tuple[int, ...]:
    """SIGTERM and SIGUSR1 where this process was started ignoring them (the launcher under an
    engine that signals every process of a job: see ``worker.agent.guard --shield``)."""
    return tuple(int(s) for s in (signal.SIGTERM, signal.SIGUSR1) if signal.getsignal(s) == signal.SIG_IGN)


def init_loader_worker(worker_id: int, ignored: tuple[int, ...] = ()) -> None:
    """DataLoader ``worker_init_fn``: seed the worker (:func:`seed_loader_worker`) and ignore
    again the signals its rank ignores (torch's workers install a SIGTERM handler of their
    own, so a preemption's SIGTERM would otherwise kill them under the ranks' feet)."""
    for sig in ignored:
        signal.signal(sig, signal.SIG_IGN)
    seed_loader_worker(worker_id)
