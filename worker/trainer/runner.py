"""One rank's whole job: set up (:mod:`.training`, resuming with :mod:`.resume`), train epoch by
epoch, publish the model."""

from __future__ import annotations

import datetime as dt
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torchvision

from torchyard import modeldir
from torchyard.scoring import ONNX_FILE
from worker.trainer import checkpoint as ckpt
from worker.trainer import distributed, rng_state
from worker.trainer.batchnorm import precise_bn_batches, recompute_batchnorm_stats
from worker.trainer.config import JobConfig
from worker.trainer.distributed import DistEnv
from worker.trainer.early_stopping import EarlyStopping
from worker.trainer.events import EventWriter
from worker.trainer.loop import EpochSummary, device_batches, diverged_error, validate
from worker.trainer.models import BuiltModel, build_model
from worker.trainer.onnx_export import export_onnx
from worker.trainer.schedule import POLY_POWER
from worker.trainer.seeding import derive_seed, seed_everything
from worker.trainer.training import Training, configure_threads, set_up

log = logging.getLogger(__name__)

MODEL_DIR = "model"


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
    training = set_up(job, env, device, built, output_dir)
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
        if training.loop.sampler is not None:
            training.loop.sampler.close()


def _train_epochs(
    t: Training,
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


def _gather_rank_states(t: Training) -> list[dict[str, Any]] | None:
    """Every rank's random states and loss sums, on rank 0 (None elsewhere)."""
    mine = {"rng": rng_state.capture(), "meter": t.loop.meter.state()}
    if t.env.world_size == 1:
        return [mine]
    gathered: list[Any] | None = [None] * t.env.world_size if t.env.is_primary else None
    torch.distributed.gather_object(mine, gathered, dst=0)
    return gathered


def _preempt(
    t: Training,
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


def _run_epoch(t: Training, epoch: int) -> tuple[EpochSummary, dict[str, float]] | None:
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
    t.hooks.at_point("validation", epoch)
    # The moving averages lag weights that change fast (a warm-up's end): the model is
    # validated and saved with statistics of its own weights (worker/trainer/batchnorm.py).
    recompute_batchnorm_stats(
        t.model,
        device_batches(t.loaders.train, t.loop.prepare, t.device),
        max_batches=precise_bn_batches(params.batch_size, t.loop.steps_per_epoch),
        autocast=t.autocast,
        progress=t.control.mark_progress,
    )
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
    t: Training,
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
    t: Training,
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
        before_replace=lambda: t.hooks.at_point("checkpoint", epoch),
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
