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
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2 as T

from torchyard.contract.jobspec import Augmentation
from torchyard.modeldir import load_rgb_image

log = logging.getLogger(__name__)

JPEG_MAGIC = b"\xff\xd8\xff"
ENV_SWITCH = "TORCHYARD_GPU_DECODE"
ENV_CPU_SHARE = "TORCHYARD_GPU_DECODE_CPU_SHARE"
# Part of the JPEGs decoded by the loader workers even with GPU decoding: none by default, since
# on a 16-core H100 node PIL workers beside nvJPEG slowed training down (bench/RESULTS.md).
DEFAULT_CPU_SHARE = 0.0

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


# Padded images of one roi_align call stay under this many bytes (large photos go in smaller groups).
GROUP_BYTES = 512 * 2**20


class GpuDecoder:
    """Decodes a batch's JPEGs on ``device`` and applies the training geometry there.

    The crop boxes are drawn per image (torchvision's ``RandomResizedCrop`` rule and
    torch's global generator); the crops and resizes of a whole batch are then one
    ``roi_align`` call on the zero-padded images, whose adaptive sampling averages
    every source pixel of an output pixel (the antialiasing of a downscale), and the
    flips one ``where``: a handful of kernels per batch instead of several per image.
    """

    def __init__(self, device: torch.device, image_size: int, augmentation: Augmentation) -> None:
        if augmentation not in (*CROP_POLICY, "none"):
            raise ValueError(f"unknown augmentation {augmentation!r}")
        self.device = device
        self.image_size = image_size
        self.augmentation = augmentation
        # Half precision holds 0..255 exactly and halves the padded batch (CUDA only).
        self.work_dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.fallbacks = 0

    def _box(self, image: torch.Tensor) -> tuple[float, float, float, float, bool]:
        """``(x1, y1, x2, y2, flip)`` of one image's crop, in source pixels."""
        _, height, width = image.shape
        if self.augmentation == "none":
            # Resize the shorter side then centre crop (Resize + CenterCrop): the centred square.
            side = min(height, width)
            left, top = (width - side) / 2, (height - side) / 2
            return left, top, left + side, top + side, False
        scale, ratio, flip = CROP_POLICY[self.augmentation]
        top, left, h, w = T.RandomResizedCrop.get_params(image, list(scale), list(ratio))
        flipped = flip and torch.rand(1).item() < 0.5
        return float(left), float(top), float(left + w), float(top + h), flipped

    def _crop_resize(self, images: list[torch.Tensor]) -> torch.Tensor:
        """uint8 ``(N, 3, size, size)`` crops of decoded CHW uint8 images of any sizes."""
        from torchvision.ops import roi_align

        size = self.image_size
        boxes = [self._box(image) for image in images]
        out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=self.device)
        order = sorted(range(len(images)), key=lambda i: images[i].shape[1] * images[i].shape[2])
        start = 0
        while start < len(order):
            # The largest images last, in groups that keep the padded tensor under GROUP_BYTES.
            stop = start + 1
            while stop < len(order):
                last = images[order[stop]]
                if (stop - start + 1) * 3 * last.shape[1] * last.shape[2] * 2 > GROUP_BYTES:
                    break
                stop += 1
            group = order[start:stop]
            height = max(images[i].shape[1] for i in group)
            width = max(images[i].shape[2] for i in group)
            padded = torch.zeros((len(group), 3, height, width), dtype=self.work_dtype, device=self.device)
            for slot, i in enumerate(group):
                image = images[i]
                padded[slot, :, : image.shape[1], : image.shape[2]] = image
            rois = torch.tensor(
                [[slot, *boxes[i][:4]] for slot, i in enumerate(group)],
                dtype=self.work_dtype,
                device=self.device,
            )
            crops = roi_align(
                padded, rois, output_size=(size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True
            )
            flips = torch.tensor([boxes[i][4] for i in group], device=self.device).view(-1, 1, 1, 1)
            crops = torch.where(flips, crops.flip(-1), crops)
            index = torch.tensor(group, device=self.device)
            out.index_copy_(0, index, crops.float().round_().clamp_(0, 255).to(torch.uint8))
            start = stop
        return out

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
            crops = self._crop_resize(self._decode([batch.payloads[i] for i in jpeg]))
            out.index_copy_(0, torch.tensor(jpeg, device=self.device), crops)
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
