"""torch.distributed plumbing: the rank's environment, process group, and small collectives."""

from __future__ import annotations

import inspect
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

DEFAULT_PG_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job (from torchrun's environment variables)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_name: str

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def read_env() -> DistEnv:
    """This rank's coordinates; without torchrun's variables, a single process."""
    env = os.environ
    return DistEnv(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        node_name=env.get("TORCHYARD_NODE_NAME") or socket.gethostname(),
    )


def is_primary() -> bool:
    """True on global rank 0 (or when no process group is running)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def pg_timeout() -> timedelta:
    """Bound on every collective (``TORCHYARD_PG_TIMEOUT_S``, default 120 s): a rank whose
    peer died fails with a timeout instead of waiting forever."""
    raw = os.environ.get("TORCHYARD_PG_TIMEOUT_S", "")
    seconds = float(raw) if raw.strip() else DEFAULT_PG_TIMEOUT_S
    if seconds <= 0:
        raise ValueError("TORCHYARD_PG_TIMEOUT_S must be positive")
    return timedelta(seconds=seconds)


def select_device(env: DistEnv) -> torch.device:
    """One GPU per local rank on CUDA machines, else the CPU (``TORCHYARD_DEVICE=cpu`` forces it)."""
    wanted = os.environ.get("TORCHYARD_DEVICE", "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"TORCHYARD_DEVICE must be 'cpu' or 'cuda', not {wanted!r}")
    if wanted == "cpu" or not torch.cuda.is_available():
        if wanted == "cuda":
            raise RuntimeError("TORCHYARD_DEVICE=cuda but no CUDA device is available")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise RuntimeError(f"local rank {env.local_rank} has no GPU: this node has {count} visible GPU(s)")
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def setup(env: DistEnv, device: torch.device) -> None:
    """Join the process group: NCCL on CUDA, gloo on CPU, with a bounded timeout."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = pg_timeout()
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            rank=env.rank,
            world_size=env.world_size,
            device_id=device if device.type == "cuda" else None,
        )
    elif env.world_size == 1:
        # Started without torchrun: a one-process group needs no rendezvous.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is not set: start the trainer with torchrun")
    log.info(
        "process group ready: backend %s, rank %d/%d, local rank %d, device %s, timeout %.0fs",
        backend,
        env.rank,
        env.world_size,
        env.local_rank,
        device,
        timeout.total_seconds(),
    )


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: Sequence[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks (one collective, float64)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]


def broadcast_values(values: Sequence[float], device: torch.device, src: int = 0) -> list[float]:
    """Rank ``src``'s numbers on every rank (one collective, float64)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.broadcast(tensor, src=src)
    return [float(v) for v in tensor.tolist()]


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s values."""
    for tensor in tensors:
        dist.broadcast(tensor, src=src)


def no_buffer_sync_kwargs() -> dict[str, Any]:
    """DDP's switch for "no buffer broadcast in forward": ``forward_sync_buffers`` in the
    torch this project pins, ``broadcast_buffers`` in releases before it (a GPU image may
    ship an older torch)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def sync_buffers(module: nn.Module, src: int = 0) -> None:
    """Give every rank rank ``src``'s buffers (BatchNorm running statistics).

    Training runs DDP without per-iteration buffer broadcasts; before validating and
    saving, all ranks take rank 0's statistics so the evaluated model is the saved one.
    """
    if dist.get_world_size() > 1:
        broadcast_tensors((b for b in module.buffers() if b.numel() > 0), src)
