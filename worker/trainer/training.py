"""One rank's training, set up: the process group, the loaders, the model on its device with
its optimizer and schedule, the state resumed from, and the loop that runs the epochs."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchyard import modeldir
from torchyard.contract.learning_rate import effective_learning_rate
from worker.system_probe import sampling_interval
from worker.trainer import checkpoint as ckpt
from worker.trainer import distributed
from worker.trainer.compiling import CompiledForward, compile_setting
from worker.trainer.config import JobConfig
from worker.trainer.control import RankControl
from worker.trainer.data import Loaders, build_loaders
from worker.trainer.distributed import DistEnv
from worker.trainer.early_stopping import EarlyStopping
from worker.trainer.events import EVENTS_FILE, EventWriter, NullEventWriter
from worker.trainer.hooks import Hooks, load_hooks
from worker.trainer.loop import (
    BatchPrepare,
    BatchPreparer,
    DecodeThenPrepare,
    LossMeter,
    TrainLoop,
    autocast_factory,
)
from worker.trainer.models import BuiltModel
from worker.trainer.resume import ResumeState, restore
from worker.trainer.schedule import build_scheduler
from worker.trainer.seeding import derive_seed
from worker.trainer.system_metrics import rank_sampler

log = logging.getLogger(__name__)

MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4


def configure_threads() -> None:
    """Respect the agent's ``OMP_NUM_THREADS`` (threads per rank) for torch's CPU ops."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        torch.set_num_threads(int(raw))


@dataclass
class Training:
    """One rank's training, set up: the model, its optimizer and schedule, the loaders,
    the state resumed from and the loop that runs the epochs."""

    job: JobConfig
    env: DistEnv
    device: torch.device
    model: nn.Module
    output_dir: Path
    loaders: Loaders
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stopper: EarlyStopping
    resumed: ResumeState
    events: EventWriter
    prepare: BatchPreparer
    autocast: Callable[[], AbstractContextManager[Any]]
    loop: TrainLoop
    effective_lr: float
    control: RankControl
    hooks: Hooks
    # Rank 0's background checkpoint writer (None on the other ranks).
    writer: ckpt.CheckpointWriter | None
    # Which epoch ends get a checkpoint (decided on rank 0).
    schedule: ckpt.CheckpointSchedule


def set_up(
    job: JobConfig, env: DistEnv, device: torch.device, built: BuiltModel, output_dir: Path
) -> Training:
    """Join the process group, build the loaders and optimizer, restore a checkpoint if
    there is one, and wrap the model in DistributedDataParallel."""
    params = job.parameters
    model = built.module
    # A bad setting fails every rank before they wait on a peer.
    interval = ckpt.checkpoint_interval()
    hooks = load_hooks(env.rank, output_dir)
    compiling = compile_setting()
    sys_interval = sampling_interval()
    distributed.setup(env, device)
    loaders = build_loaders(job, env, device)
    steps_per_epoch = loaders.steps_per_epoch
    total_steps = steps_per_epoch * params.epochs
    warmup_steps = steps_per_epoch * params.warmup_epochs
    effective_lr = effective_learning_rate(params.learning_rate, env.world_size)

    optimizer = _place_model(model, device, effective_lr)
    stopper = EarlyStopping(patience=params.patience)
    resumed = restore(job, env, device, model, optimizer, stopper)
    start_epoch = resumed.epochs_done
    start_step = start_epoch * steps_per_epoch + resumed.step_in_epoch
    if start_epoch:
        # Fresh loader worker streams for a resumed attempt (the augmentation itself is
        # seeded per sample: see data.SeededSamples).
        loaders.generator.manual_seed(derive_seed(params.random_seed, "loader", env.rank, start_epoch))
    scheduler = build_scheduler(
        optimizer,
        base_lr=effective_lr,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        start_step=min(start_step, total_steps),
    )
    # BatchNorm buffers are synchronised explicitly before validation (distributed.sync_buffers).
    # Gradients as views of DDP's buckets save a copy on CUDA; on the CPU, with the
    # optimizer's set_to_none zeroing, they cost 3-5 % of a step (bench/RESULTS.md).
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=device.type == "cuda",
        **distributed.no_buffer_sync_kwargs(),
    )

    events: EventWriter = EventWriter(output_dir / EVENTS_FILE) if env.is_primary else NullEventWriter()
    prepare = BatchPreparer(device, modeldir.IMAGENET_MEAN, modeldir.IMAGENET_STD)
    train_prepare: BatchPrepare = prepare
    if loaders.on_device is not None:
        train_prepare = DecodeThenPrepare(loaders.on_device, prepare)
    autocast = autocast_factory(device)
    forward = CompiledForward(ddp, setting=compiling, device=device, batch_size=params.batch_size)
    control = RankControl(output_dir, env.rank, device)
    writer = _checkpoint_writer(output_dir, hooks) if env.is_primary else None
    loop = TrainLoop(
        model=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loaders.train,
        steps_per_epoch=steps_per_epoch,
        prepare=train_prepare,
        autocast=autocast,
        meter=LossMeter(device, learning_rate=params.learning_rate, effective_lr=effective_lr),
        events=events,
        hooks=hooks,
        device=device,
        epochs=params.epochs,
        total_steps=total_steps,
        print_frequency=params.print_frequency,
        is_primary=env.is_primary,
        step=start_step,
        control=control,
        forward=forward,
        sampler=rank_sampler(output_dir, env.rank, device, sys_interval),
    )
    log.info(
        "training %s for epochs %d..%d: %d steps/epoch, %d warm-up steps, effective lr %g on %d process(es)",
        job.model.architecture,
        start_epoch + 1,
        params.epochs,
        steps_per_epoch,
        warmup_steps,
        effective_lr,
        env.world_size,
    )
    return Training(
        job=job,
        env=env,
        device=device,
        model=model,
        output_dir=output_dir,
        loaders=loaders,
        optimizer=optimizer,
        scheduler=scheduler,
        stopper=stopper,
        resumed=resumed,
        events=events,
        prepare=prepare,
        autocast=autocast,
        loop=loop,
        effective_lr=effective_lr,
        control=control,
        hooks=hooks,
        writer=writer,
        schedule=ckpt.CheckpointSchedule(writer, interval),
    )


def _checkpoint_writer(output_dir: Path, hooks: Hooks) -> ckpt.CheckpointWriter | None:
    """Rank 0's writer; none when a trainer hook turns checkpoints off (a benchmark's
    baseline without checkpoints: such a job cannot resume)."""
    if not hooks.writes_checkpoints():
        log.warning("a trainer hook turned the checkpoints off: no checkpoint is written")
        return None
    return ckpt.CheckpointWriter(output_dir / ckpt.CHECKPOINT_FILE)


def _place_model(model: nn.Module, device: torch.device, learning_rate: float) -> torch.optim.SGD:
    """Move the model to the device (channels-last on CUDA) and make its optimizer."""
    memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    model.to(device)
    model.to(memory_format=memory_format)
    # The fused CUDA kernel steps every parameter at once (measured: bench/RESULTS.md).
    return torch.optim.SGD(
        model.parameters(),
        lr=learning_rate,
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
        fused=True if device.type == "cuda" else None,
    )
