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
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

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


# Attempts at a crop of the wanted area and aspect before the centre-crop fallback (torchvision's rule).
CROP_ATTEMPTS = 10
# Padded images of one roi_align call stay under this many bytes (large photos go in smaller groups).
GROUP_BYTES = 512 * 2**20


def crop_boxes(sizes: torch.Tensor, augmentation: Augmentation) -> tuple[torch.Tensor, torch.Tensor]:
    """``(boxes, flips)`` for images of ``sizes`` (``(N, 2)``: height, width): ``(N, 4)`` float64
    ``(left, top, width, height)`` in source pixels, and ``(N,)`` bools.

    The whole batch at once, on the CPU with torch's global generator: torchvision's
    ``RandomResizedCrop`` rule (up to ten draws of an area and an aspect ratio, the first that
    fits, else the centre crop of the nearest allowed ratio), then a random position and flip.
    """
    sizes = sizes.to(torch.float64)
    height, width = sizes[:, 0], sizes[:, 1]
    count = sizes.shape[0]
    if augmentation == "none":
        # Resize the shorter side then centre crop (Resize + CenterCrop): the centred square.
        side = torch.minimum(height, width)
        boxes = torch.stack([(width - side) / 2, (height - side) / 2, side, side], dim=1)
        return boxes, torch.zeros(count, dtype=torch.bool)
    (low, high), (ratio_low, ratio_high), flip = CROP_POLICY[augmentation]
    draws = torch.rand(count, CROP_ATTEMPTS, dtype=torch.float64)
    area = (height * width)[:, None] * (low + draws * (high - low))
    log_low, log_high = math.log(ratio_low), math.log(ratio_high)
    draws = torch.rand(count, CROP_ATTEMPTS, dtype=torch.float64)
    aspect = torch.exp(log_low + draws * (log_high - log_low))
    w = torch.sqrt(area * aspect).round()
    h = torch.sqrt(area / aspect).round()
    fits = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)
    found = fits.any(dim=1)
    # No draw fits: the whole image, cropped to the nearest allowed aspect ratio.
    ratio = width / height
    fallback_w = torch.where(ratio > ratio_high, (height * ratio_high).round(), width)
    fallback_h = torch.where(ratio < ratio_low, (width / ratio_low).round(), height)
    crop_w = torch.where(found, w.gather(1, first)[:, 0], fallback_w)
    crop_h = torch.where(found, h.gather(1, first)[:, 0], fallback_h)
    position = torch.rand(count, 2, dtype=torch.float64)
    top = torch.where(
        found, (position[:, 0] * (height - crop_h + 1)).floor(), ((height - crop_h) / 2).floor()
    )
    left = torch.where(found, (position[:, 1] * (width - crop_w + 1)).floor(), ((width - crop_w) / 2).floor())
    flips = torch.rand(count) < 0.5 if flip else torch.zeros(count, dtype=torch.bool)
    return torch.stack([left, top, crop_w, crop_h], dim=1), flips


class GpuDecoder:
    """Decodes a batch's JPEGs on ``device`` and applies the training geometry there.

    The crop boxes of the whole batch are drawn at once (:func:`crop_boxes`: torchvision's
    ``RandomResizedCrop`` rule with torch's global generator, a few tensor operations per
    batch rather than several per image); the crops and resizes of the whole batch are then
    one ``roi_align`` call on the zero-padded images, whose adaptive sampling averages every
    source pixel of an output pixel (the antialiasing of a downscale), and the flips one
    ``where``: a handful of kernels per batch beside one copy per image into the padded batch.
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

    def _boxes(self, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's crop boxes and flips (:func:`crop_boxes`)."""
        return crop_boxes(sizes, self.augmentation)

    def _crop_resize(self, images: list[torch.Tensor]) -> torch.Tensor:
        """uint8 ``(N, 3, size, size)`` crops of decoded CHW uint8 images of any sizes."""
        from torchvision.ops import roi_align

        size = self.image_size
        sizes = torch.tensor([[image.shape[1], image.shape[2]] for image in images], dtype=torch.int64)
        boxes, flips = self._boxes(sizes)
        corners = torch.cat([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], dim=1)  # x1, y1, x2, y2
        out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=self.device)
        pixels = (sizes[:, 0] * sizes[:, 1]).tolist()
        order = sorted(range(len(images)), key=lambda i: pixels[i])
        start = 0
        while start < len(order):
            # The largest images last, in groups that keep the padded tensor under GROUP_BYTES.
            stop = start + 1
            while stop < len(order) and (stop - start + 1) * 3 * pixels[order[stop]] * 2 <= GROUP_BYTES:
                stop += 1
            group = order[start:stop]
            height = max(images[i].shape[1] for i in group)
            width = max(images[i].shape[2] for i in group)
            padded = torch.zeros((len(group), 3, height, width), dtype=self.work_dtype, device=self.device)
            for slot, i in enumerate(group):
                image = images[i]
                padded[slot, :, : image.shape[1], : image.shape[2]] = image
            index = torch.tensor(group)
            rois = torch.cat([torch.arange(len(group), dtype=torch.float64)[:, None], corners[index]], dim=1)
            crops = roi_align(
                padded,
                rois.to(self.device, self.work_dtype),
                output_size=(size, size),
                spatial_scale=1.0,
                sampling_ratio=-1,
                aligned=True,
            )
            flipped = flips[index].to(self.device).view(-1, 1, 1, 1)
            crops = torch.where(flipped, crops.flip(-1), crops)
            out.index_copy_(0, index.to(self.device), crops.float().round_().clamp_(0, 255).to(torch.uint8))
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
