"""The training and validation loops."""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from torchyard.contract.errors import TrainingDivergedError
from torchyard.modeldir import channel_stats, normalize_batch
from worker.trainer.compiling import CompiledForward
from worker.trainer.control import RankControl, StopCheck
from worker.trainer.distributed import all_reduce_sum
from worker.trainer.events import EventWriter
from worker.trainer.hooks import Hooks
from worker.trainer.system_metrics import NO_SAMPLER, SystemSampler

log = logging.getLogger(__name__)

# Weight of auxiliary classifier losses (GoogLeNet, Inception v3) in training.
AUX_LOSS_WEIGHT = 0.3


def autocast_factory(device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    """Mixed precision as a context factory: bf16 autocast on CUDA, nothing on the CPU."""
    if device.type == "cuda":
        return lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


class BatchPreparer:
    """Moves a uint8 batch to the device and normalizes it there (channels_last on CUDA)."""

    def __init__(self, device: torch.device, mean: Iterable[float], std: Iterable[float]) -> None:
        self.device = device
        self.mean = channel_stats(list(mean), device)
        self.std = channel_stats(list(std), device)
        self.channels_last = device.type == "cuda"

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        batch = normalize_batch(images, self.mean, self.std)
        if self.channels_last:
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch, targets


BatchPrepare = Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor]]


class DecodeThenPrepare:
    """A GPU-decoded training batch (uint8 pixels on the device) normalized by ``prepare``."""

    def __init__(
        self, decode: Callable[[Any], tuple[torch.Tensor, torch.Tensor]], prepare: BatchPreparer
    ) -> None:
        self.decode = decode
        self.prepare = prepare

    def __call__(self, batch: Any, _targets: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        images, targets = self.decode(batch)
        return self.prepare(images, targets)


def device_batches(
    loader: Iterable[Any], prepare: BatchPrepare, device: torch.device, *, depth: int = 2
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, prepared on the device.

    On CUDA a feeder thread prepares up to ``depth`` batches ahead on a CUDA stream of
    its own (the copy to the device and, with GPU decoding, the decoding and cropping),
    so that work overlaps the training step queued by this thread. An error in the
    feeder is raised here.
    """
    if device.type != "cuda":
        for item in loader:
            yield prepare(*_split(item))
        return
    feeder = _Feeder(loader, prepare, device, depth)
    try:
        while True:
            item = feeder.queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            batch, labels, ready = item
            current = torch.cuda.current_stream(device)
            current.wait_event(ready)
            # Made on the feeder's stream, used on this one: the allocator must not reuse them early.
            batch.record_stream(current)
            labels.record_stream(current)
            yield batch, labels
    finally:
        feeder.close()


_END = object()


class _Feeder:
    """The thread behind :func:`device_batches` on CUDA."""

    def __init__(
        self, loader: Iterable[Any], prepare: BatchPrepare, device: torch.device, depth: int
    ) -> None:
        self.loader = loader
        self.prepare = prepare
        self.device = device
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="batch-feeder", daemon=True)
        self.thread.start()

    def _offer(self, item: Any) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                for item in self.loader:
                    batch, labels = self.prepare(*_split(item))
                    ready = torch.cuda.Event()
                    ready.record(stream)
                    if not self._offer((batch, labels, ready)):
                        return
            self._offer(_END)
        except BaseException as exc:  # handed to the training thread, which raises it
            self._offer(exc)

    def close(self) -> None:
        self.stopping.set()
        while self.thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self.queue.get_nowait()
            self.thread.join(timeout=0.1)


def _split(item: Any) -> tuple[Any, Any]:
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    return item, None


def model_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a model's training output; auxiliary heads (GoogLeNet's
    ``aux_logits1/2``, Inception's ``aux_logits``) add a down-weighted term."""
    if isinstance(output, torch.Tensor):
        return F.cross_entropy(output, targets)
    loss = F.cross_entropy(output.logits, targets)
    for name in ("aux_logits", "aux_logits1", "aux_logits2"):
        aux = getattr(output, name, None)
        if isinstance(aux, torch.Tensor):
            loss = loss + AUX_LOSS_WEIGHT * F.cross_entropy(aux, targets)
    return loss


def diverged_error(
    value: float, *, epoch: int, step: int, learning_rate: float, effective_lr: float
) -> TrainingDivergedError:
    return TrainingDivergedError(
        f"training diverged: the loss became {value} at epoch {epoch}, step {step}. "
        f"Lower the learning rate: learning_rate is {learning_rate:g} (effective {effective_lr:g} "
        f"after scaling by the number of processes); try {learning_rate / 10:g} or less."
    )


class LossMeter:
    """Reads each iteration's loss back to the host, checks it is finite, and sums it.

    On CUDA the value is copied into pinned memory asynchronously and read one
    iteration later, so the check never stalls the GPU queue; on the CPU it is read at
    once. A NaN/inf loss raises ``TrainingDivergedError`` on the rank that sees it.
    """

    def __init__(self, device: torch.device, *, learning_rate: float, effective_lr: float) -> None:
        self.device = device
        self.learning_rate = learning_rate
        self.effective_lr = effective_lr
        self._pending: tuple[torch.Tensor, Any, int, int] | None = None
        self._buffers: list[torch.Tensor] = []
        if device.type == "cuda":
            self._buffers = [torch.empty((), dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self._next_buffer = 0
        self.window_sum = 0.0
        self.window_count = 0
        self.epoch_sum = 0.0
        self.epoch_count = 0

    def push(self, loss: torch.Tensor, *, epoch: int, step: int) -> None:
        if self.device.type != "cuda":
            self._record(float(loss.detach().item()), epoch, step)
            return
        buffer = self._buffers[self._next_buffer]
        self._next_buffer ^= 1
        # The previous iteration's buffer must be read before its slot is reused.
        self.drain()
        buffer.copy_(loss.detach().float(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (buffer, event, epoch, step)

    def drain(self) -> None:
        if self._pending is None:
            return
        buffer, event, epoch, step = self._pending
        self._pending = None
        event.synchronize()
        self._record(float(buffer.item()), epoch, step)

    def _record(self, value: float, epoch: int, step: int) -> None:
        if not math.isfinite(value):
            raise diverged_error(
                value,
                epoch=epoch,
                step=step,
                learning_rate=self.learning_rate,
                effective_lr=self.effective_lr,
            )
        self.window_sum += value
        self.window_count += 1
        self.epoch_sum += value
        self.epoch_count += 1

    def take_window(self) -> tuple[float, int]:
        self.drain()
        result = (self.window_sum, self.window_count)
        self.window_sum, self.window_count = 0.0, 0
        return result

    def state(self) -> list[float]:
        """Sums of the epoch and window so far (for a mid-epoch checkpoint)."""
        self.drain()
        return [self.epoch_sum, float(self.epoch_count), self.window_sum, float(self.window_count)]

    def load_state(self, values: list[float]) -> None:
        self.epoch_sum, self.window_sum = float(values[0]), float(values[2])
        self.epoch_count, self.window_count = int(values[1]), int(values[3])

    def take_epoch(self) -> tuple[float, int]:
        self.drain()
        result = (self.epoch_sum, self.epoch_count)
        self.epoch_sum, self.epoch_count = 0.0, 0
        self.window_sum, self.window_count = 0.0, 0
        return result


@dataclass
class EpochSummary:
    loss: float
    lr: float
    images_per_sec: float
    images: int
    seconds: float


@dataclass
class TrainLoop:
    """Everything one rank needs to run training epochs."""

    model: nn.Module  # the DistributedDataParallel wrapper
    optimizer: Optimizer
    scheduler: LRScheduler
    loader: Iterable[Any]
    steps_per_epoch: int
    prepare: BatchPrepare
    autocast: Callable[[], AbstractContextManager[Any]]
    meter: LossMeter
    events: EventWriter
    hooks: Hooks
    device: torch.device
    epochs: int
    total_steps: int
    print_frequency: int
    is_primary: bool
    step: int = 0
    control: RankControl | None = None
    # Steps into the epoch when the ranks agreed to stop for a preemption (else None).
    preempted_at: int | None = None
    # The training forward pass, eager or compiled (else the model itself); it decides at each
    # epoch's end whether to compile for the rest of the job.
    forward: CompiledForward | None = None
    # This rank's system metrics (worker/trainer/system_metrics.py); None when they are off.
    sampler: SystemSampler | None = None

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_epoch(self, epoch: int, start_index: int = 0) -> EpochSummary | None:
        """One pass over this rank's shard; ``epoch`` is 1-based. A resumed epoch starts at
        batch ``start_index`` (the sampler skips the batches already trained on). None when
        the ranks stopped for a preemption (``preempted_at`` says after which batch)."""
        self.model.train()
        started = window_start = time.perf_counter()
        window_images = epoch_images = 0
        lr = self.current_lr()
        batches = device_batches(self.loader, self.prepare, self.device)
        index = start_index
        check: StopCheck | None = None
        sampler = self.sampler or NO_SAMPLER
        while True:
            # The next batch is fetched while the last step boundary's stop check travels
            # (fetching changes no training state: each sample's augmentation is seeded).
            asked = time.perf_counter()
            item = next(batches, None)
            fetched = time.perf_counter()
            if check is not None and check.agreed():
                self.preempted_at = index
                log.info("preemption requested: every rank stops after step %d of epoch %d", index, epoch)
                if isinstance(batches, Generator):
                    batches.close()
                return None
            if item is None:
                break
            batch, labels = item
            self.hooks.before_step(self.step)
            with self.autocast():
                loss = model_loss((self.forward or self.model)(batch), labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            lr = self.current_lr()
            self.scheduler.step()
            self.step += 1
            self.meter.push(loss, epoch=epoch, step=self.step)
            window_images += labels.shape[0]
            epoch_images += labels.shape[0]
            last = index + 1 == self.steps_per_epoch
            if self.step % self.print_frequency == 0 and not last:
                now = time.perf_counter()
                self._report_window(epoch, index + 1, lr, window_images, now - window_start)
                window_start, window_images = now, 0
            index += 1
            check = None
            if self.control is not None:
                self.control.mark_progress()
            if index == self.steps_per_epoch // 2:
                self.hooks.at_point("train", epoch)
            if self.control is not None and not last:
                check = self.control.start_stop_check()
            sampler.step_done(epoch, self.step, started=asked, fetched=fetched, now=time.perf_counter())
        sampler.flush(epoch, self.step)
        elapsed = time.perf_counter() - started
        loss_sum, count = self.meter.take_epoch()
        total_loss, total_count, total_images = all_reduce_sum([loss_sum, count, epoch_images], self.device)
        summary = EpochSummary(
            loss=total_loss / max(1.0, total_count),
            lr=lr,
            images_per_sec=total_images / max(elapsed, 1e-9),
            images=int(total_images),
            seconds=elapsed,
        )
        if self.forward is not None and index > start_index:
            remaining = (self.epochs - epoch) * self.steps_per_epoch
            self.forward.after_epoch(elapsed / (index - start_index), remaining)
        self._emit_train(epoch, summary.loss, summary.lr, summary.images_per_sec)
        log.info(
            "epoch %d/%d done: step %d/%d, train loss %.4f, lr %.6g, %.1f images/s (all ranks), %.1fs",
            epoch,
            self.epochs,
            self.step,
            self.total_steps,
            summary.loss,
            lr,
            summary.images_per_sec,
            elapsed,
        )
        return summary

    def _report_window(self, epoch: int, epoch_step: int, lr: float, images: int, seconds: float) -> None:
        loss_sum, count = self.meter.take_window()
        total_loss, total_count, total_images = all_reduce_sum([loss_sum, count, images], self.device)
        loss = total_loss / max(1.0, total_count)
        rate = total_images / max(seconds, 1e-9)
        log.info(
            "epoch %d/%d step %d/%d (%d/%d in epoch): loss %.4f, lr %.6g, %.1f images/s (all ranks)",
            epoch,
            self.epochs,
            self.step,
            self.total_steps,
            epoch_step,
            self.steps_per_epoch,
            loss,
            lr,
            rate,
        )
        self._emit_train(epoch, loss, lr, rate)

    def _emit_train(self, epoch: int, loss: float, lr: float, rate: float) -> None:
        if not self.is_primary:
            return
        self.events.metric("train.loss", loss, epoch=epoch, step=self.step)
        self.events.metric("train.lr", lr, epoch=epoch, step=self.step)
        self.events.metric("train.images_per_sec", rate, epoch=epoch, step=self.step)
        self.events.progress(epoch=epoch, epochs=self.epochs, step=self.step, total_steps=self.total_steps)


@torch.inference_mode()
def validate(
    module: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    prepare: BatchPreparer,
    autocast: Callable[[], AbstractContextManager[Any]],
    num_classes: int,
    device: torch.device,
    progress: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Loss, top-1 (and top-5 with >= 5 classes) over every rank's validation shard.

    ``module`` is the plain model, not the DDP wrapper: ranks may hold different
    numbers of validation batches, so no collective may run per batch. Only the sums
    are all-reduced at the end.
    """
    module.eval()
    k = min(5, num_classes)
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top-1, top-k, count
    for images, targets in loader:
        batch, labels = prepare(images, targets)
        with autocast():
            logits = module(batch)
        logits = logits.float()
        sums[0] += F.cross_entropy(logits, labels, reduction="sum").double()
        sums[1] += (logits.argmax(dim=1) == labels).sum()
        sums[2] += (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum()
        sums[3] += labels.shape[0]
        if progress is not None:
            progress()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    loss_sum, top1, topk, count = (float(v) for v in sums.tolist())
    if count == 0:
        raise RuntimeError("the validation set is empty")
    metrics = {"val.loss": loss_sum / count, "val.top1": top1 / count}
    if num_classes >= 5:
        metrics["val.top5"] = topk / count
    return metrics
