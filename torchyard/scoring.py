"""Scoring without torch: a model directory's ONNX export run by ONNX Runtime.

The API process scores images with this module (it never imports torch, README.md); the
benchmark in ``bench/bench_predict.py`` compares it with torch eager. Preprocessing is
exactly :func:`torchyard.modeldir.eval_transform`'s, written with Pillow and NumPy:

1. decode as RGB;
2. resize the shorter side to ``eval_resize`` (``int(image_size / 0.875)``) with
   Pillow's bilinear filter, the longer side to ``int(resize * long / short)`` (what
   torchvision's ``Resize`` does with a PIL image);
3. centre crop ``image_size`` (offsets rounded as torchvision's ``CenterCrop``);
4. ``(x / 255 - mean) / std`` in float32, CHW.

So a model served by the API and the same model directory loaded locally with torch
give the same inputs to the same weights.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

if TYPE_CHECKING:
    import numpy as np

CONFIG_FILE = "config.json"
ONNX_FILE = "model.onnx"
# The evaluation resize keeps the ImageNet recipe's crop ratio (torchyard.modeldir).
EVAL_CROP_RATIO = 0.875
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: The largest difference between ONNX Runtime's and torch's logits an export may show.
ONNX_TOLERANCE = 1e-4


def eval_resize_size(image_size: int) -> int:
    return int(image_size / EVAL_CROP_RATIO)


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """The ``(width, height)`` torchvision's ``Resize(size)`` gives: shorter side ``size``."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def eval_geometry(image: Image.Image, image_size: int) -> np.ndarray:
    """Resize and centre crop an RGB image as validation does: a uint8 ``(3, S, S)`` array."""
    import numpy as np

    size = resized_size(image.width, image.height, eval_resize_size(image_size))
    if size != image.size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    width, height = image.size
    top = round((height - image_size) / 2.0)
    left = round((width - image_size) / 2.0)
    image = image.crop((left, top, left + image_size, top + image_size))
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).copy()


def normalize(batch: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 ``(N, 3, H, W)`` to float32 ``(x / 255 - mean) / std`` (float32 throughout)."""
    import numpy as np

    mean_a = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std_a = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    result: np.ndarray = (batch.astype(np.float32) / np.float32(255.0) - mean_a) / std_a
    return result


def softmax(logits: np.ndarray) -> np.ndarray:
    import numpy as np

    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    result: np.ndarray = exp / exp.sum(axis=1, keepdims=True)
    return result


def top_k(probs: np.ndarray, classes: Sequence[str], k: int) -> list[list[tuple[str, float]]]:
    """Per row, the ``k`` most probable ``(label, probability)``, highest first (ties: lower index)."""
    import numpy as np

    k = max(1, min(k, len(classes)))
    out: list[list[tuple[str, float]]] = []
    for row in probs:
        order = np.argsort(-row, kind="stable")[:k]
        out.append([(classes[int(i)], float(row[int(i)])) for i in order])
    return out


def session_options(threads: int | None = None) -> Any:
    """ONNX Runtime's options for scoring, spelled out rather than left to defaults:
    every graph optimization (constant folding, Conv+BatchNorm+ReLU fusion, layout
    transforms), sequential execution (a classifier is one chain of operators: parallel
    execution only adds scheduling), memory-pattern planning and the CPU arena (the same
    shapes recur request after request), one inter-op thread, and ``threads`` intra-op
    threads (None: one per physical core, ONNX Runtime's choice, as torch's)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.enable_mem_pattern = True
    options.enable_cpu_mem_arena = True
    options.inter_op_num_threads = 1
    if threads is not None:
        options.intra_op_num_threads = threads
    return options


@dataclass
class OnnxModel:
    """An ONNX Runtime session with the model directory's classes and preprocessing."""

    session: Any
    input_name: str
    classes: list[str]
    image_size: int
    mean: list[float]
    std: list[float]
    size_bytes: int

    @classmethod
    def load(cls, folder: str | Path, *, threads: int | None = None) -> OnnxModel:
        """Load ``config.json`` and ``model.onnx`` of a model directory."""
        import onnxruntime as ort

        folder = Path(folder)
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        options = session_options(threads)
        onnx_path = folder / ONNX_FILE
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        return cls(
            session=session,
            input_name=session.get_inputs()[0].name,
            classes=[str(c) for c in config["classes"]],
            image_size=int(config["image_size"]),
            mean=[float(v) for v in config.get("mean", IMAGENET_MEAN)],
            std=[float(v) for v in config.get("std", IMAGENET_STD)],
            size_bytes=onnx_path.stat().st_size,
        )

    def geometry(self, image: Image.Image) -> np.ndarray:
        """One RGB image resized and centre cropped to the model's input: uint8 ``(3, S, S)``."""
        return eval_geometry(image, self.image_size)

    def preprocess(self, images: Iterable[Image.Image]) -> np.ndarray:
        """The model's input batch; ``images`` is read one at a time and each is kept only as
        its crop, so a generator that decodes lazily holds one full-size image at a time."""
        import numpy as np

        batch = np.stack([self.geometry(image) for image in images])
        return normalize(batch, self.mean, self.std)

    def logits(self, inputs: np.ndarray) -> np.ndarray:
        result: np.ndarray = self.session.run(None, {self.input_name: inputs})[0]
        return result

    def predict(self, images: Iterable[Image.Image], k: int) -> list[list[tuple[str, float]]]:
        """The ``k`` most probable labels of each RGB image (read as :meth:`preprocess` does)."""
        return top_k(softmax(self.logits(self.preprocess(images))), self.classes, k)


class ModelCache:
    """A small LRU of loaded models, bounded by count and by the bytes of their ONNX files.

    Thread-safe: loading happens outside the lock, so one slow load does not hold up
    requests for models already loaded (two threads may load the same model once each).
    """

    def __init__(self, max_models: int, max_bytes: int) -> None:
        self.max_models = max(1, max_models)
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, OnnxModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, folder: Path) -> OnnxModel:
        with self._lock:
            model = self._items.get(key)
            if model is not None:
                self._items.move_to_end(key)
                return model
        model = OnnxModel.load(folder)
        with self._lock:
            self._items[key] = model
            self._items.move_to_end(key)
            self._evict()
        return model

    def _evict(self) -> None:
        # The newest model stays even if alone it is over the byte budget.
        while len(self._items) > 1 and (
            len(self._items) > self.max_models
            or sum(m.size_bytes for m in self._items.values()) > self.max_bytes
        ):
            self._items.popitem(last=False)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def discard(self, prefix: str) -> None:
        with self._lock:
            for key in [k for k in self._items if k.startswith(prefix)]:
                del self._items[key]
