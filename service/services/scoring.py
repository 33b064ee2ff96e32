"""Scoring uploaded images with a registered model, in the API process, without torch.

Each image is decoded as dataset images are (the supported formats only, the pixel cap
read from the header before any pixel is decoded) and refused with a 422 naming the file
when it is not a readable image. Before any image is decoded, the headers of all of them
are read: a request whose images add up to more than the per-request pixel cap is a 413.
Each image is then decoded and at once resized and cropped to the model's input size, so
a request holds one full-size image at a time, never all of them. The model runs through
ONNX Runtime from its export (:mod:`torchyard.scoring`), with the model directory's own
preprocessing; loaded models stay in a small LRU cache bounded by count and bytes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

from service.services.models import ModelFiles
from torchyard.contract.errors import ModelNotReadyError, PayloadTooLargeError, RequestValidationError
from torchyard.scoring import ONNX_FILE, ModelCache

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


def check_total_pixels(uploads: list[UploadedImage], max_pixels: int, max_total_pixels: int) -> None:
    """413 when the images of a request add up to more than ``max_total_pixels`` (from
    their headers, before any is decoded); 422 for the first unreadable or too large one."""
    total = sum(image_pixels(upload, max_pixels) for upload in uploads)
    if total > max_total_pixels:
        raise PayloadTooLargeError(
            f"the images of this request hold {total} pixels together, more than the limit of "
            f"{max_total_pixels} per request: send them in several requests",
            details={"pixels": total, "limit": max_total_pixels},
        )


def predict(
    cache: ModelCache,
    files: ModelFiles,
    uploads: list[UploadedImage],
    top_k: int,
    max_pixels: int,
    max_total_pixels: int,
) -> list[list[tuple[str, float]]]:
    """The ``top_k`` labels and probabilities of each upload, in order."""
    if not (files.folder / ONNX_FILE).is_file():
        raise ModelNotReadyError(
            "this model version has no ONNX export (it was dropped at training time, see the "
            "job's log): the service scores models through their ONNX export"
        )
    check_total_pixels(uploads, max_pixels, max_total_pixels)
    model = cache.get(files.key, files.folder)
    # Decoded lazily: the model keeps only each image's crop, one full-size image at a time.
    return model.predict((decode_image(upload, max_pixels) for upload in uploads), top_k)
