"""Scoring uploaded images with a registered model, in the API process, without torch.

Each image is decoded as dataset images are (the supported formats only, the pixel cap
read from the header before any pixel is decoded) and refused with a 422 naming the file
when it is not a readable image. Before any image is decoded, the headers of all of them
are read: a request whose images add up to more than the per-request pixel cap is a 413.
The cap counts each image's pixels after resizing too. Each image is then decoded and at
once resized and cropped to the model's input size, so a request holds one full-size image
at a time, never all of them. The model runs through ONNX Runtime from its export
(:mod:`torchyard.scoring`) in a separate scoring process, under memory and CPU limits
(:mod:`service.services.scoring_pool`), never in the API process.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image

from service.services.models import ModelFiles
from torchyard.contract.errors import ModelNotReadyError, PayloadTooLargeError, RequestValidationError
from torchyard.scoring import ONNX_FILE, eval_geometry, eval_resize_size, resized_size

if TYPE_CHECKING:
    import numpy as np

# Pillow format names of the supported extensions (as for datasets).
_PILLOW_FORMATS = ("JPEG", "PNG", "BMP", "WEBP", "GIF", "TIFF")
MAX_TOP_K = 100


@dataclass(frozen=True)
class UploadedImage:
    filename: str
    data: bytes


def _refusal(upload: UploadedImage, reason: str) -> RequestValidationError:
    return RequestValidationError(
        f"file {upload.filename!r}: {reason}", details={"file": upload.filename, "reason": reason}
    )


def _open_image(upload: UploadedImage, max_pixels: int, *, decode: bool) -> tuple[int, Image.Image | None]:
    """The upload's pixel count from its header and, with ``decode``, the image as RGB;
    422 naming the file when it is not a readable image, or larger than ``max_pixels``."""
    try:
        with Image.open(io.BytesIO(upload.data), formats=_PILLOW_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise _refusal(upload, f"{width}x{height} pixels, more than the limit of {max_pixels}")
            if not decode:
                return width * height, None
            image.load()
            return width * height, image.convert("RGB")
    except RequestValidationError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _refusal(upload, f"larger than the limit of {max_pixels} pixels (decompression bomb)") from None
    except Image.UnidentifiedImageError:
        raise _refusal(upload, "not a supported image (jpg, png, bmp, webp, gif or tif)") from None
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError...) on bad data
        raise _refusal(upload, f"cannot be decoded ({type(exc).__name__})") from None


def image_pixels(upload: UploadedImage, max_pixels: int) -> int:
    """The upload's width × height, read from its header alone (nothing is decoded)."""
    return _open_image(upload, max_pixels, decode=False)[0]


def decode_image(upload: UploadedImage, max_pixels: int) -> Image.Image:
    """The upload as an RGB image; 422 naming the file when it is not one, or too large."""
    image = _open_image(upload, max_pixels, decode=True)[1]
    assert image is not None
    return image


def check_total_pixels(
    uploads: list[UploadedImage], max_pixels: int, max_total_pixels: int, image_size: int | None = None
) -> None:
    """413 when the images of a request add up to more than ``max_total_pixels`` (from
    their headers, before any is decoded); 422 for the first unreadable or too large one.
    With the model's ``image_size``, each image counts the larger of its pixels and those
    of its resized copy (the shorter side resized to ``eval_resize_size(image_size)``), so
    small images upscaled by a model of a large input size count what they will weigh."""
    total = 0
    for upload in uploads:
        _open_image(upload, max_pixels, decode=False)
        total += _weight(upload, image_size)
    if total > max_total_pixels:
        raise PayloadTooLargeError(
            f"the images of this request hold {total} pixels together, more than the limit of "
            f"{max_total_pixels} per request: send them in several requests",
            details={"pixels": total, "limit": max_total_pixels},
        )


def _weight(upload: UploadedImage, image_size: int | None) -> int:
    with Image.open(io.BytesIO(upload.data)) as image:
        width, height = image.size
    pixels = width * height
    if image_size is None or width < 1 or height < 1:
        return pixels
    new_width, new_height = resized_size(width, height, eval_resize_size(image_size))
    return max(pixels, new_width * new_height)


def prepare_batch(
    files: ModelFiles,
    uploads: list[UploadedImage],
    image_size: int,
    max_pixels: int,
    max_total_pixels: int,
) -> np.ndarray:
    """The uint8 ``(N, 3, S, S)`` crops of the uploads, as the model's validation transform
    makes them (scored then by :class:`ScoringPool`)."""
    import numpy as np

    if not (files.folder / ONNX_FILE).is_file():
        raise ModelNotReadyError(
            "this model version has no ONNX export (it was dropped at training time, see the "
            "job's log): the service scores models through their ONNX export"
        )
    check_total_pixels(uploads, max_pixels, max_total_pixels, image_size)
    # Decoded one at a time: only each image's crop is kept.
    return np.stack([eval_geometry(decode_image(upload, max_pixels), image_size) for upload in uploads])
