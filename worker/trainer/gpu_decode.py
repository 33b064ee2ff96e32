"""Training images decoded on the GPU: JPEG bytes in, augmented uint8 batches out.

On a GPU node the CPU is what limits an image pipeline: PIL decoding and cropping a
photo-sized JPEG costs a loader worker several milliseconds, so 15 workers on 16 cores
fed ResNet-50 on an H100 at well under half of what the GPU trains at (see
``bench/RESULTS.md``). With GPU decoding the loader workers only read files; the main
process decodes each batch's JPEGs with nvJPEG (``torchvision.io.decode_jpeg`` on the
device, one batched call) and applies the training geometry there: the same random
resized crop / flip parameters as the CPU transforms, bilinear resampling with
antialiasing. Files of other formats (PNG, BMP, ...) are decoded and transformed by
the workers as before and join the batch as pixels.

Validation keeps the CPU pipeline, so the numbers a job reports are those of the
model directory's own evaluation (``torchyard.modeldir``).

``TORCHYARD_GPU_DECODE=0`` turns GPU decoding off (``auto``, the default, uses it on
CUDA when torchvision's nvJPEG decoder works).
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2 as T

from torchyard.modeldir import load_rgb_image
from worker.trainer.config import Augmentation

log = logging.getLogger(__name__)

JPEG_MAGIC = b"\xff\xd8\xff"
ENV_SWITCH = "TORCHYARD_GPU_DECODE"
ENV_CPU_SHARE = "TORCHYARD_GPU_DECODE_CPU_SHARE"
# Part of the JPEGs decoded by the loader workers even with GPU decoding (bench/RESULTS.md).
DEFAULT_CPU_SHARE = 0.35

# (scale, ratio, flip) of the random resized crop of each augmentation level; the CPU
# transforms in worker.trainer.data use the same values.
CROP_POLICY: dict[str, tuple[tuple[float, float], tuple[float, float], bool]] = {
    "standard": ((0.08, 1.0), (3 / 4, 4 / 3), True),
    "light": ((0.8, 1.0), (0.9, 1.1), False),
}


@dataclass
class EncodedBatch:
    """A collated batch of :class:`EncodedTrainSet` items."""

    payloads: list[np.ndarray]  # encoded JPEG bytes, or uint8 CHW pixels
    is_jpeg: list[bool]
    targets: torch.Tensor

    def pin_memory(self) -> EncodedBatch:
        return EncodedBatch(self.payloads, self.is_jpeg, self.targets.pin_memory())


class EncodedTrainSet(Dataset[tuple[np.ndarray, bool, int]]):
    """``(payload, is_jpeg, target)``: a JPEG file's bytes, or any other image (and the
    ``cpu_share`` of the JPEGs) decoded and transformed here by ``cpu_transform`` (uint8
    CHW pixels).

    Payloads travel as numpy arrays (pickled by value) rather than tensors: a batch of
    hundreds of small tensors would need a shared-memory file descriptor each.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        cpu_transform: Callable[[Image.Image], torch.Tensor],
        cpu_share: float = 0.0,
    ) -> None:
        self.samples = list(samples)
        self.cpu_transform = cpu_transform
        # A fixed, evenly spread part of the JPEGs is decoded here anyway: the loader
        # workers' cores and the GPU decoder then work side by side.
        self.cpu_per_mille = round(min(1.0, max(0.0, cpu_share)) * 1000)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[np.ndarray, bool, int]:
        path, target = self.samples[index]
        with open(path, "rb") as fh:
            data = fh.read()
        if data[:3] == JPEG_MAGIC and (index * 7919) % 1000 >= self.cpu_per_mille:
            return np.frombuffer(bytearray(data), dtype=np.uint8), True, target
        return self.cpu_transform(load_rgb_image(path)).numpy(), False, target


def encoded_collate(items: list[tuple[np.ndarray, bool, int]]) -> EncodedBatch:
    return EncodedBatch(
        payloads=[item[0] for item in items],
        is_jpeg=[item[1] for item in items],
        targets=torch.tensor([item[2] for item in items], dtype=torch.int64),
    )


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 CHW -> float NCHW resized with antialiased bilinear filtering (as PIL's)."""
    return F.interpolate(
        image.unsqueeze(0).float(), size=size, mode="bilinear", antialias=True, align_corners=False
    )


def _store(out: torch.Tensor, index: int, resized: torch.Tensor) -> None:
    out[index] = resized[0].round_().clamp_(0, 255).to(torch.uint8)


class GpuDecoder:
    """Decodes a batch's JPEGs on ``device`` and applies the training geometry there."""

    def __init__(self, device: torch.device, image_size: int, augmentation: Augmentation) -> None:
        if augmentation not in (*CROP_POLICY, "none"):
            raise ValueError(f"unknown augmentation {augmentation!r}")
        self.device = device
        self.image_size = image_size
        self.augmentation = augmentation
        self.fallbacks = 0

    def _geometry(self, out: torch.Tensor, index: int, image: torch.Tensor) -> None:
        size = self.image_size
        _, height, width = image.shape
        if self.augmentation == "none":
            # Resize the shorter side to ``size``, then centre crop (torchvision's Resize + CenterCrop).
            short, long = (height, width) if height <= width else (width, height)
            new_long = int(size * long / short)
            new_h, new_w = (size, new_long) if height <= width else (new_long, size)
            resized = _resize(image, (new_h, new_w))
            top, left = round((new_h - size) / 2), round((new_w - size) / 2)
            _store(out, index, resized[..., top : top + size, left : left + size])
            return
        scale, ratio, flip = CROP_POLICY[self.augmentation]
        top, left, h, w = T.RandomResizedCrop.get_params(image, list(scale), list(ratio))
        resized = _resize(image[:, top : top + h, left : left + w], (size, size))
        if flip and torch.rand(1).item() < 0.5:
            resized = resized.flip(-1)
        _store(out, index, resized)

    def _decode(self, payloads: list[np.ndarray]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        data = [torch.from_numpy(p) for p in payloads]
        try:
            return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device))
        except RuntimeError as exc:
            # nvJPEG refuses a few valid files (some CMYK or unusual subsamplings): PIL takes them.
            self.fallbacks += 1
            if self.fallbacks == 1:
                log.warning("GPU JPEG decoding failed for a batch (%s); decoding it on the CPU", exc)
            pixels = []
            for payload in payloads:
                with Image.open(io.BytesIO(payload.tobytes())) as img:
                    pixels.append(torch.from_numpy(np.asarray(img.convert("RGB"))).permute(2, 0, 1))
            return [p.to(self.device, non_blocking=False) for p in pixels]

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        count = len(batch.payloads)
        out = torch.empty((count, 3, self.image_size, self.image_size), dtype=torch.uint8, device=self.device)
        jpeg = [i for i in range(count) if batch.is_jpeg[i]]
        if jpeg:
            for i, image in zip(jpeg, self._decode([batch.payloads[i] for i in jpeg]), strict=True):
                self._geometry(out, i, image)
        for i in range(count):
            if not batch.is_jpeg[i]:
                out[i] = torch.from_numpy(batch.payloads[i]).to(self.device, non_blocking=False)
        return out, batch.targets.to(self.device, non_blocking=True)


def gpu_decode_wanted() -> bool:
    raw = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if raw in ("0", "off", "false", "no"):
        return False
    if raw not in ("", "auto", "1", "on", "true", "yes"):
        raise ValueError(f"{ENV_SWITCH} must be auto, on or off, not {raw!r}")
    return True


def cpu_share() -> float:
    """``TORCHYARD_GPU_DECODE_CPU_SHARE`` (0..1): the part of the JPEGs the loader workers decode."""
    raw = os.environ.get(ENV_CPU_SHARE, "").strip()
    if not raw:
        return DEFAULT_CPU_SHARE
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{ENV_CPU_SHARE} must be a number from 0 to 1, not {raw!r}")
    return value


def gpu_decode_works(device: torch.device) -> bool:
    """Whether torchvision can decode a JPEG on ``device`` (its nvJPEG build and the driver)."""
    if device.type != "cuda":
        return False
    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        buffer = io.BytesIO()
        Image.new("RGB", (16, 16), (200, 30, 60)).save(buffer, format="JPEG")
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        decoded = decode_jpeg([data], mode=ImageReadMode.RGB, device=device)[0]
        return tuple(decoded.shape) == (3, 16, 16)
    except Exception as exc:  # any failure means: use the CPU pipeline
        log.info("GPU JPEG decoding unavailable (%s): decoding on the CPU", exc)
        return False
