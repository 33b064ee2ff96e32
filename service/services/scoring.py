"""Scoring uploaded images with a registered model, in the API process, without torch.

Each image is decoded as dataset images are (the supported formats only, the pixel cap
read from the header before any pixel is decoded) and refused with a 422 naming the file
when it is not a readable image. The model runs through ONNX Runtime from its export
(:mod:`torchyard.scoring`), with the model directory's own preprocessing; loaded models
stay in a small LRU cache bounded by count and bytes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

from service.services.models import ModelFiles
from torchyard.contract.errors import ModelNotReadyError, RequestValidationError
from torchyard.scoring import ONNX_FILE, ModelCache

# Pillow format names of the supported extensions (as for datasets).
_PILLOW_FORMATS = ("JPEG", "PNG", "BMP", "WEBP", "GIF", "TIFF")
MAX_TOP_K = 100


@dataclass(frozen=True)
class UploadedImage:
    filename: str
    data: bytes


def decode_image(upload: UploadedImage, max_pixels: int) -> Image.Image:
    """The upload as an RGB image; 422 naming the file when it is not one, or too large."""

    def refuse(reason: str) -> RequestValidationError:
        return RequestValidationError(
            f"file {upload.filename!r}: {reason}", details={"file": upload.filename, "reason": reason}
        )

    try:
        with Image.open(io.BytesIO(upload.data), formats=_PILLOW_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise refuse(f"{width}x{height} pixels, more than the limit of {max_pixels}")
            image.load()
            return image.convert("RGB")
    except RequestValidationError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise refuse(f"larger than the limit of {max_pixels} pixels (decompression bomb)") from None
    except Image.UnidentifiedImageError:
        raise refuse("not a supported image (jpg, png, bmp, webp, gif or tif)") from None
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError...) on bad data
        raise refuse(f"cannot be decoded ({type(exc).__name__})") from None


def predict(
    cache: ModelCache, files: ModelFiles, uploads: list[UploadedImage], top_k: int, max_pixels: int
) -> list[list[tuple[str, float]]]:
    """The ``top_k`` labels and probabilities of each upload, in order."""
    if not (files.folder / ONNX_FILE).is_file():
        raise ModelNotReadyError(
            "this model version has no ONNX export (it was dropped at training time, see the "
            "job's log): the service scores models through their ONNX export"
        )
    images = [decode_image(upload, max_pixels) for upload in uploads]
    model = cache.get(files.key, files.folder)
    return model.predict(images, top_k)
