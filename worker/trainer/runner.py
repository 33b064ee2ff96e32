"""One rank's whole job: set up, (resume,) train epoch by epoch, publish the model."""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchyard import modeldir
from torchyard.scoring import ONNX_FILE
from worker.trainer import checkpoint as ckpt
from worker.trainer import distributed, rng_state
from worker.trainer.compiling import CompiledForward, compile_setting
from worker.trainer.config import JobConfig
from worker.trainer.control import RankControl
from worker.trainer.data import Loaders, build_loaders
from worker.trainer.distributed import DistEnv
from worker.trainer.early_stopping import EarlyStopping
from worker.trainer.engine import (
    BatchPrepare,
    BatchPreparer,
    DecodeThenPrepare,
    EpochSummary,
    FaultInjector,
    LossMeter,
    TrainLoop,
    autocast_factory,
    diverged_error,
    validate,
)
from worker.trainer.events import EVENTS_FILE, EventWriter, NullEventWriter
from worker.trainer.models import BuiltModel, build_model
from worker.trainer.onnx_export import export_onnx
from worker.trainer.schedule import POLY_POWER, build_scheduler
from worker.trainer.seeding import derive_seed, seed_everything

log = logging.getLogger(__name__)

MODEL_DIR = "model"
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4


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


def configure_threads() -> None:
    """Respect the agent's ``OMP_NUM_THREADS`` (threads per rank) for torch's CPU ops."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        torch.set_num_threads(int(raw))


def _plain(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, nn.Module) else model


def _restore(
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


def _model_config(
    job: JobConfig, built: BuiltModel, env: DistEnv, device: torch.device, summary: dict[str, Any]
) -> dict[str, Any]:
    params = job.parameters
    datasets = None
    if job.datasets is not None:
        datasets = {
            "train": {"id": job.datasets.train.id, "sha256": job.datasets.train.sha256},
            "validation": {"id": job.datasets.validation.id, "sha256": job.datasets.validation.sha256},
        }
    return {
        "format_version": modeldir.FORMAT_VERSION,
        "architecture": job.model.architecture,
        "num_classes": job.num_classes,
        "classes": list(job.classes),
        "image_size": params.image_size,
        "eval_resize": modeldir.eval_resize_size(params.image_size),
        "mean": list(modeldir.IMAGENET_MEAN),
        "std": list(modeldir.IMAGENET_STD),
        "model_kwargs": built.model_kwargs,
        "best_epoch": summary["best_epoch"],
        "stopped_early": summary["stopped_early"],
        "epochs_run": summary["epochs_run"],
        "parameters": params.model_dump(),
        "augmentation": params.augmentation,
        "pretrained": job.model.pretrained,
        "initialized_from": built.initialized_from,
        "datasets": datasets,
        "world_size": env.world_size,
        "device": device.type,
        "mixed_precision": "bf16" if device.type == "cuda" else None,
        "lr_schedule": {"warmup": "linear", "decay": "polynomial", "power": POLY_POWER},
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "job_id": job.job_id,
        "attempt_id": job.attempt_id,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def _val_metrics(entry: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in entry.items() if k.startswith("val.")}


def run_job(job: JobConfig, env: DistEnv) -> dict[str, Any] | None:
    """Train the job on this rank. Rank 0 returns the result summary, other ranks None
    (rank 0 returns ``{"preempted": True}`` after a preemption checkpoint)."""
    configure_threads()
    output_dir = Path(job.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    device = distributed.select_device(env)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if env.is_primary:
        log.info("job configuration: %s", job.summary().replace("\n", "\n  "))

    # Model problems fail every rank the same way, before anyone waits on a peer.
    seed_everything(derive_seed(job.parameters.random_seed, "init"))
    built = build_model(job)
    training = _set_up(job, env, device, built, output_dir)
    try:
        history, best_state, stopped, preempted = _train_epochs(training)
        if training.writer is not None:
            training.writer.wait()  # the last checkpoint is whole before the result is announced
        if preempted:
            return {"preempted": True} if env.is_primary else None
        if not env.is_primary:
            return None
        if best_state is None or not history:
            raise RuntimeError("no trained epoch to publish")
        return _publish(
            job,
            env,
            device,
            built,
            training.events,
            output_dir,
            training.stopper,
            history,
            best_state,
            stopped,
        )
    finally:
        if training.writer is not None:
            training.writer.close()  # a failing run still leaves its last checkpoint whole
        training.events.close()


@dataclass
class _Training:
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
    # Rank 0's background checkpoint writer (None on the other ranks).
    writer: ckpt.CheckpointWriter | None
    # Which epoch ends get a checkpoint (decided on rank 0).
    schedule: ckpt.CheckpointSchedule


def _set_up(
    job: JobConfig, env: DistEnv, device: torch.device, built: BuiltModel, output_dir: Path
) -> _Training:
    """Join the process group, build the loaders and optimizer, restore a checkpoint if
    there is one, and wrap the model in DistributedDataParallel."""
    params = job.parameters
    model = built.module
    interval = ckpt.checkpoint_interval()  # a bad setting fails every rank before they wait on a peer
    compiling = compile_setting()
    distributed.setup(env, device)
    loaders = build_loaders(job, env, device)
    steps_per_epoch = loaders.steps_per_epoch
    total_steps = steps_per_epoch * params.epochs
    warmup_steps = steps_per_epoch * params.warmup_epochs
    effective_lr = params.learning_rate * env.world_size

    optimizer = _place_model(model, device, effective_lr)
    stopper = EarlyStopping(patience=params.patience)
    resumed = _restore(job, env, device, model, optimizer, stopper)
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
    if loaders.gpu_decoder is not None:
        train_prepare = DecodeThenPrepare(loaders.gpu_decoder, prepare)
    autocast = autocast_factory(device)
    forward = CompiledForward(ddp, setting=compiling, device=device, batch_size=params.batch_size)
    control = RankControl(output_dir, env.rank, device)
    writer = _checkpoint_writer(output_dir) if env.is_primary else None
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
        faults=FaultInjector(env.rank),
        device=device,
        epochs=params.epochs,
        total_steps=total_steps,
        print_frequency=params.print_frequency,
        is_primary=env.is_primary,
        step=start_step,
        control=control,
        forward=forward,
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
    return _Training(
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
        writer=writer,
        schedule=ckpt.CheckpointSchedule(writer, interval),
    )


def _checkpoint_writer(output_dir: Path) -> ckpt.CheckpointWriter | None:
    """Rank 0's writer; none when ``TORCHYARD_BENCH_NO_CHECKPOINTS=1`` (a benchmark's
    baseline without checkpoints: such a job cannot resume; never set in production)."""
    if os.environ.get("TORCHYARD_BENCH_NO_CHECKPOINTS", "") == "1":
        log.warning("TORCHYARD_BENCH_NO_CHECKPOINTS=1: no checkpoint is written")
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


def _train_epochs(
    t: _Training,
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor] | None, bool, bool]:
    """Train and validate epoch after epoch until the last, an early stop or a preemption;
    the history, the best epoch's weights (rank 0), whether training stopped early and
    whether it was preempted (its checkpoint written)."""
    params = t.job.parameters
    history = t.resumed.history
    best_state = t.resumed.best_model
    stopped = t.resumed.stopped
    epoch = t.resumed.epochs_done
    while not stopped and epoch < params.epochs:
        epoch += 1
        epoch_started = time.perf_counter()
        ran = _run_epoch(t, epoch)
        if ran is None:
            _preempt(t, epoch, best_state, history, stopped)
            return history, best_state, stopped, True
        train, val = ran
        improved = t.stopper.update(val["val.loss"], epoch)
        stopped = t.stopper.should_stop
        seconds = time.perf_counter() - epoch_started
        history.append(
            {
                "epoch": epoch,
                "train.loss": train.loss,
                "train.lr": train.lr,
                "train.images_per_sec": train.images_per_sec,
                **val,
                "epoch.seconds": seconds,
            }
        )
        log.info(
            "epoch %d/%d validation: %s%s",
            epoch,
            params.epochs,
            ", ".join(f"{k} {v:.4f}" for k, v in val.items()),
            " (best so far)" if improved else f" (best: epoch {t.stopper.best_epoch})",
        )
        preempted = False
        write = True  # the last epoch and an early stop always get their checkpoint
        if not stopped and epoch < params.epochs:
            # One all-reduce: any rank's preemption request, and rank 0's schedule.
            due = t.schedule.due() if t.env.is_primary else False
            preempted, due = t.control.epoch_end_agreed(checkpoint_due=due)
            write = due or preempted
        checkpoint_started = time.perf_counter()
        rank_states = _gather_rank_states(t) if write else None
        if t.env.is_primary:
            best_state = _record_epoch(
                t,
                epoch,
                val,
                seconds,
                improved,
                best_state,
                history,
                stopped,
                rank_states,
                checkpoint_started,
                write=write,
            )
        if stopped and epoch < params.epochs:
            log.info("stopping early: no lower validation loss for %d epochs", params.patience)
        if preempted:
            # Preempted between epochs: the epoch's checkpoint is the one to resume from.
            if t.env.is_primary:
                if t.writer is not None:
                    t.writer.wait()  # written and renamed before preempted.json says so
                t.control.write_preempted(epoch, 0, t.loop.step)
            log.info("preempted after epoch %d: its checkpoint is written", epoch)
            return history, best_state, stopped, True
    return history, best_state, stopped, False


def _gather_rank_states(t: _Training) -> list[dict[str, Any]] | None:
    """Every rank's random states and loss sums, on rank 0 (None elsewhere)."""
    mine = {"rng": rng_state.capture(), "meter": t.loop.meter.state()}
    if t.env.world_size == 1:
        return [mine]
    gathered: list[Any] | None = [None] * t.env.world_size if t.env.is_primary else None
    torch.distributed.gather_object(mine, gathered, dst=0)
    return gathered


def _preempt(
    t: _Training,
    epoch: int,
    best_state: dict[str, torch.Tensor] | None,
    history: list[dict[str, float]],
    stopped: bool,
) -> None:
    """All ranks stopped after the same step of ``epoch``: rank 0 writes the mid-epoch
    checkpoint (every rank's random states gathered to it), then ``preempted.json``."""
    done = t.loop.preempted_at or 0
    started = time.perf_counter()
    rank_states = _gather_rank_states(t)
    log.info("preempted at step %d of epoch %d (global step %d)", done, epoch, t.loop.step)
    if not t.env.is_primary:
        return
    current = modeldir.plain_state_dict(t.model)
    _save_checkpoint(
        t,
        epoch=epoch - 1,
        step_in_epoch=done,
        model_state=current,
        best_model=best_state,
        history=history,
        stopped=stopped,
        rank_states=rank_states,
        started=started,
    )
    if t.writer is not None:
        t.writer.wait()  # written and renamed before preempted.json says so
    t.control.write_preempted(epoch - 1, done, t.loop.step)


def _run_epoch(t: _Training, epoch: int) -> tuple[EpochSummary, dict[str, float]] | None:
    """One training pass and validation; a non-finite validation metric fails the job.
    None when the ranks stopped mid-epoch for a preemption.

    A mid-epoch resume continues the interrupted epoch at its next batch, with this
    rank's random states and loss sums as they were: the rest of the epoch runs as it
    would have without the interruption.
    """
    params = t.job.parameters
    start_index = 0
    resumed = t.resumed
    if resumed.step_in_epoch and epoch == resumed.epochs_done + 1:
        start_index = resumed.step_in_epoch
        resumed.step_in_epoch = 0
        t.loaders.train_sampler.skip = start_index * params.batch_size
        if resumed.rank_state is not None:
            rng_state.restore(resumed.rank_state["rng"])
            t.loop.meter.load_state(list(resumed.rank_state["meter"]))
        log.info("resuming epoch %d at batch %d", epoch, start_index + 1)
    else:
        seed_everything(derive_seed(params.random_seed, "epoch", epoch, t.env.rank))
    t.loaders.train_sampler.set_epoch(epoch)
    train = t.loop.train_epoch(epoch, start_index)
    if train is None:
        return None
    t.control.pause_point("validation", epoch)
    distributed.sync_buffers(t.model)
    val = validate(
        t.model,
        t.loaders.val,
        prepare=t.prepare,
        autocast=t.autocast,
        num_classes=t.job.num_classes,
        device=t.device,
        progress=t.control.mark_progress,
    )
    if not all(math.isfinite(v) for v in val.values()):
        raise diverged_error(
            val["val.loss"],
            epoch=epoch,
            step=t.loop.step,
            learning_rate=params.learning_rate,
            effective_lr=t.effective_lr,
        )
    return train, val


def _record_epoch(
    t: _Training,
    epoch: int,
    val: dict[str, float],
    seconds: float,
    improved: bool,
    best_state: dict[str, torch.Tensor] | None,
    history: list[dict[str, float]],
    stopped: bool,
    rank_states: list[dict[str, Any]] | None,
    started: float,
    *,
    write: bool = True,
) -> dict[str, torch.Tensor] | None:
    """Rank 0: the epoch's metric and progress events and, when ``write``, its
    checkpoint; the best epoch's weights so far. ``started``: when the ranks began
    gathering the checkpoint's random states (what training waits for the checkpoint is
    counted from there)."""
    step = t.loop.step
    for name, value in (*val.items(), ("epoch.seconds", seconds)):
        t.events.metric(name, value, epoch=epoch, step=step)
    t.events.progress(epoch=epoch, epochs=t.job.parameters.epochs, step=step, total_steps=t.loop.total_steps)
    if not write:
        if improved:
            best_state = modeldir.plain_state_dict(t.model)
        if t.schedule.last is not None:
            log.info(
                "no checkpoint after epoch %d: %.1fs since the last one, less than the interval (%.1fs)",
                epoch,
                time.monotonic() - t.schedule.last,
                t.schedule.interval(),
            )
        return best_state
    current = modeldir.plain_state_dict(t.model)
    if improved:
        best_state = current
    _save_checkpoint(
        t,
        epoch=epoch,
        step_in_epoch=0,
        model_state=current,
        best_model=None if improved else best_state,
        history=history,
        stopped=stopped,
        rank_states=rank_states,
        started=started,
    )
    return best_state


def _save_checkpoint(
    t: _Training,
    *,
    epoch: int,
    step_in_epoch: int,
    model_state: dict[str, torch.Tensor],
    best_model: dict[str, torch.Tensor] | None,
    history: list[dict[str, float]],
    stopped: bool,
    rank_states: list[dict[str, Any]] | None,
    started: float,
) -> None:
    """Rank 0: hand the state to the background writer. Training waits only for the
    previous write to end (normally long done) and for a copy of the optimizer state;
    ``model_state`` and ``best_model`` are already copies of their own (CPU, never changed)."""
    if t.writer is None:
        return
    job = t.job
    where = f"epoch {epoch}" if not step_in_epoch else f"step {step_in_epoch} of epoch {epoch + 1}"
    waited = t.writer.submit(
        {
            "job_id": job.job_id,
            "architecture": job.model.architecture,
            "classes": list(job.classes),
            "world_size": t.env.world_size,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "step": t.loop.step,
            "sampler_epoch": t.loaders.train_sampler.epoch,
            "model": model_state,
            "optimizer": ckpt.detached(t.optimizer.state_dict()),
            "scheduler": ckpt.detached(t.scheduler.state_dict()),
            "early_stopping": dict(t.stopper.state_dict()),
            "best_metric": t.stopper.best_loss,
            "best_epoch": t.stopper.best_epoch,
            "best_model": best_model,
            "history": ckpt.detached(history),
            "stopped": stopped,
            "rank_states": rank_states or [],
        },
        label=where,
        before_replace=lambda: t.control.pause_point("checkpoint", epoch),
    )
    t.schedule.handed_over()
    log.info(
        "checkpoint after %s handed to the writer: training waited %.3fs (%.3fs of it for the previous write)",
        where,
        time.perf_counter() - started,
        waited,
    )


def _publish(
    job: JobConfig,
    env: DistEnv,
    device: torch.device,
    built: BuiltModel,
    events: EventWriter,
    output_dir: Path,
    stopper: EarlyStopping,
    history: list[dict[str, float]],
    best_state: dict[str, torch.Tensor],
    stopped: bool,
) -> dict[str, Any]:
    """Rank 0: write the model directory (best epoch's weights) and the result event."""
    epochs_run = int(history[-1]["epoch"])
    best_entry = next(h for h in history if int(h["epoch"]) == stopper.best_epoch)
    summary: dict[str, Any] = {
        "best_epoch": stopper.best_epoch,
        "best": _val_metrics(best_entry),
        "final": {k: v for k, v in history[-1].items() if k != "epoch"},
        "stopped_early": bool(stopped and epochs_run < job.parameters.epochs),
        "epochs_run": epochs_run,
    }
    metrics = {**summary, "history": history}
    config = _model_config(job, built, env, device, summary)

    onnx_file, config["onnx"] = export_onnx(best_state, config, job.val_dir, output_dir)

    def announce(_: Path) -> None:
        events.result(**summary)

    destination = modeldir.write_model_dir(
        output_dir / MODEL_DIR,
        best_state,
        config,
        metrics,
        before_publish=announce,
        extra_files={ONNX_FILE: onnx_file} if onnx_file is not None else None,
    )
    if onnx_file is not None:
        shutil.rmtree(onnx_file.parent, ignore_errors=True)
    log.info(
        "model directory written: best epoch %d (%s), %d epoch(s) run%s",
        summary["best_epoch"],
        ", ".join(f"{k} {v:.4f}" for k, v in summary["best"].items()),
        epochs_run,
        ", stopped early" if summary["stopped_early"] else "",
    )
    log.debug("model directory at %s", destination)
    return summary
