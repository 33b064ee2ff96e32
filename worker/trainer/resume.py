"""Where a rank's training starts: a fresh start, or the state of the job's checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.trainer import checkpoint as ckpt
from worker.trainer import distributed
from worker.trainer.config import JobConfig
from worker.trainer.distributed import DistEnv
from worker.trainer.early_stopping import EarlyStopping

log = logging.getLogger(__name__)


@dataclass
class ResumeState:
    """What a resumed attempt starts from (zeros/empties for a fresh start)."""

    epochs_done: int = 0
    stopped: bool = False
    stopper: dict[str, float | int] | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    best_model: dict[str, torch.Tensor] | None = None
    # A mid-epoch checkpoint: batches of epoch ``epochs_done + 1`` already trained, the
    # optimizer step count, and this rank's own random states and loss sums.
    step_in_epoch: int = 0
    step: int | None = None
    rank_state: dict[str, Any] | None = None


def restore(
    job: JobConfig,
    env: DistEnv,
    device: torch.device,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stopper: EarlyStopping,
) -> ResumeState:
    """Load ``checkpoint.pt`` on rank 0 and share what every rank needs.

    Rank 0 loads weights before DDP wraps the model (DDP then broadcasts them) and
    the optimizer state; its momentum buffers and the epoch/early-stopping counters
    are broadcast, so nodes that lack the file resume identically.
    """
    state: dict[str, Any] | None = None
    if env.is_primary:
        state = ckpt.load_checkpoint(
            Path(job.output_dir) / ckpt.CHECKPOINT_FILE,
            job_id=job.job_id,
            architecture=job.model.architecture,
            classes=list(job.classes),
        )
    header = [0.0] * 6
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        es = state["early_stopping"]
        header = [
            1.0,
            float(state["epoch"]),
            float(bool(state.get("stopped"))),
            float(es["best_loss"]),
            float(es["best_epoch"]),
            float(es["epochs_without_improvement"]),
        ]
    has, epochs_done, stopped, best_loss, best_epoch, bad = distributed.broadcast_values(header, device)
    if not has:
        return ResumeState()
    stopper.load_state_dict(
        {"best_loss": best_loss, "best_epoch": int(best_epoch), "epochs_without_improvement": int(bad)}
    )
    for group in optimizer.param_groups:
        for param in group["params"]:
            slot = optimizer.state[param]
            if slot.get("momentum_buffer") is None:
                slot["momentum_buffer"] = torch.zeros_like(param)
    distributed.broadcast_tensors(
        optimizer.state[p]["momentum_buffer"] for g in optimizer.param_groups for p in g["params"]
    )
    resumed = ResumeState(epochs_done=int(epochs_done), stopped=bool(stopped), stopper=stopper.state_dict())
    _share_position(state, env, resumed)
    if state is not None:
        resumed.history = list(state.get("history", []))
        # No separate copy means the checkpointed weights are the best epoch's.
        resumed.best_model = state.get("best_model") or state["model"]
        log.info("resuming after epoch %d (best epoch %d so far)", resumed.epochs_done, stopper.best_epoch)
    return resumed


def _share_position(state: dict[str, Any] | None, env: DistEnv, resumed: ResumeState) -> None:
    """Give every rank the resume position and its own random states (from rank 0's file)."""
    shared: list[Any] = [None]
    if state is not None:
        shared[0] = {
            "step_in_epoch": int(state.get("step_in_epoch", 0)),
            "step": state.get("step"),
            "rank_states": state.get("rank_states") or [],
        }
    if env.world_size > 1:
        torch.distributed.broadcast_object_list(shared, src=0)
    position = shared[0] or {}
    resumed.step_in_epoch = int(position.get("step_in_epoch", 0))
    step = position.get("step")
    resumed.step = int(step) if step is not None else None
    rank_states = position.get("rank_states") or []
    if len(rank_states) == env.world_size:
        resumed.rank_state = rank_states[env.rank]
    elif resumed.step_in_epoch:
        log.warning(
            "the checkpoint was written by %d process(es), this attempt has %d: the data order and "
            "random streams of the interrupted epoch are not restored exactly",
            len(rank_states),
            env.world_size,
        )
