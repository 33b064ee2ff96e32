"""Shared pieces of the GPU benchmarks: the ResNet-50 training step, timing and GPU sampling."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn


def describe_device() -> str:
    """The GPU's name, memory, driver, and the torch/CUDA versions, in one line."""
    props = torch.cuda.get_device_properties(0)
    driver = ""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        driver = f", driver {out.stdout.strip()}"
    return (
        f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs{driver}); "
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}"
    )


@dataclass
class GpuSampler:
    """Samples GPU utilisation (NVML) in a thread while a measured window runs."""

    interval: float = 0.1
    samples: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _read(self) -> Callable[[], int] | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            return lambda: int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:
            return None

    def __enter__(self) -> GpuSampler:
        read = self._read()
        if read is None:
            return self

        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.samples.append(read())

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def resnet50(num_classes: int = 1000) -> nn.Module:
    model = torchvision.models.get_model("resnet50", weights=None, num_classes=num_classes)
    return model.cuda().to(memory_format=torch.channels_last)


def sgd(model: nn.Module, *, fused: bool) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {"fused": True} if fused else {}
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, **kwargs)


def train_step_fn(
    model: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One bf16-autocast SGD step (the trainer's order: forward, zero_grad, backward, step)."""

    def step(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


@contextlib.contextmanager
def timed_window() -> Iterator[dict[str, float]]:
    """Wall time of a window of GPU work, synchronised at both ends."""
    result: dict[str, float] = {}
    torch.cuda.synchronize()
    started = time.perf_counter()
    yield result
    torch.cuda.synchronize()
    result["seconds"] = time.perf_counter() - started


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join(lines)
