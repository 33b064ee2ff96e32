"""The trained-model directory: writer, checksum manifest, loader and inference helpers.

A model directory (docs/models.md) holds:

- ``config.json``: format version, architecture, class names in output order, the
  evaluation geometry (``image_size``) and normalization (``mean``/``std``), the
  training parameters and provenance (versions, dataset checksums, best epoch...);
- ``model.safetensors``: the plain model's ``state_dict`` (no DDP ``module.`` prefix),
  loadable without unpickling anything;
- ``metrics.json``: final and best metrics plus the per-epoch history;
- ``SHA256SUMS``: ``<sha256>  <filename>`` lines for the three files above.

The loader here turns a downloaded directory back into an ``nn.Module`` plus class
names without the service running::

    model, classes, config = load_model("digits-model")
    predict("digits-model", ["seven.png"])  # [[("7", 0.98), ("1", 0.01), ...]]

The ImageDirectory helpers (how class folders and image files are found) live here
too, so the trainer and :func:`evaluate_dir` read a dataset the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torchvision
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn
from torchvision.transforms import v2 as T

from torchyard.architectures import CLASSIFICATION_ARCHITECTURES
from torchyard.contract.dataset_digest import is_ignored_name, is_image_name
from torchyard.contract.errors import InvalidDatasetError, InvalidModelDirectoryError
from torchyard.contract.files import sha256_file as sha256_file  # the weights' checksum of a model directory
from torchyard.contract.model_archive import resolve_model_dir, verify_model_dir

__all__ = ["resolve_model_dir", "verify_model_dir"]  # torch-free, re-exported for the loader's users

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
METRICS_FILE = "metrics.json"
MANIFEST_FILE = "SHA256SUMS"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, METRICS_FILE)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The evaluation resize keeps the ImageNet recipe's crop ratio (224 crop of a 256 resize).
EVAL_CROP_RATIO = 0.875


# --------------------------------------------------------------------------- ImageDirectory


def _visible_entries(folder: Path) -> list[Path]:
    """Entries of ``folder`` without hidden files and archive-tool litter (``__MACOSX``...)."""
    return sorted(p for p in folder.iterdir() if not is_ignored_name(p.name))


def image_directory_root(root: str | Path, classes: Sequence[str] | None = None) -> Path:
    """The folder holding the class sub-folders: ``root`` itself, or its one wrapping folder.

    A dataset may be wrapped in a single top-level folder (``digits/0/..., digits/1/...``),
    as archives often are; hidden entries and ``__MACOSX`` are ignored when deciding.
    When the expected ``classes`` are given and ``root``'s folders are exactly those,
    ``root`` is the answer even if it holds a single (class) folder.
    """
    path = Path(root)
    if not path.is_dir():
        raise InvalidDatasetError(f"dataset folder {path.name!r} does not exist")
    entries = _visible_entries(path)
    if classes is not None and {p.name for p in entries if p.is_dir()} == set(classes):
        return path
    if len(entries) == 1 and entries[0].is_dir():
        inner = [p for p in _visible_entries(entries[0]) if p.is_dir()]
        if inner:
            return entries[0]
    return path


def image_directory_classes(root: str | Path) -> list[str]:
    """Sorted class names (sub-folder names) of an ImageDirectory."""
    base = image_directory_root(root)
    return sorted(p.name for p in _visible_entries(base) if p.is_dir())


def is_image_file(path: Path) -> bool:
    return is_image_name(path.name) and not is_ignored_name(path.name)


def image_directory_samples(root: str | Path, classes: Sequence[str]) -> list[tuple[str, int]]:
    """``(image path, class index)`` pairs of an ImageDirectory, in a stable sorted order.

    The class index is the position in ``classes`` (the job's ordered class list). The
    dataset's class folders must be exactly ``classes``; images may sit in nested
    folders below their class folder.
    """
    base = image_directory_root(root, classes)
    found = {p.name for p in _visible_entries(base) if p.is_dir()}
    expected = set(classes)
    if found != expected:
        missing, extra = sorted(expected - found), sorted(found - expected)
        parts = []
        if missing:
            parts.append(f"missing class folders {missing}")
        if extra:
            parts.append(f"unexpected class folders {extra}")
        raise InvalidDatasetError(
            f"dataset {base.name!r} does not match the job's classes: " + "; ".join(parts)
        )
    samples: list[tuple[str, int]] = []
    for index, name in enumerate(classes):
        class_dir = base / name
        files = [
            p
            for p in sorted(class_dir.rglob("*"))
            if p.is_file()
            and is_image_file(p)
            and not any(is_ignored_name(part) for part in p.relative_to(class_dir).parts)
        ]
        if not files:
            raise InvalidDatasetError(f"class {name!r} of dataset {base.name!r} has no images")
        samples.extend((str(p), index) for p in files)
    return samples


def load_rgb_image(path: str | Path) -> Image.Image:
    """Decode an image file as RGB, turning decoding failures into ``InvalidDatasetError``."""
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    # PIL reports damaged files through several exception types, depending on the format.
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise InvalidDatasetError(f"cannot read image {Path(path).name!r}: {exc}") from exc


# --------------------------------------------------------------------------- transforms


def eval_resize_size(image_size: int) -> int:
    return int(image_size / EVAL_CROP_RATIO)


def eval_geometry(image_size: int) -> T.Compose:
    """Evaluation geometry: resize to ``image_size / 0.875`` then centre crop; uint8 CHW output."""
    return T.Compose(
        [
            T.Resize(eval_resize_size(image_size), antialias=True),
            T.CenterCrop(image_size),
            T.PILToTensor(),
        ]
    )


def channel_stats(values: Sequence[float] | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-channel ``mean``/``std`` as a float32 ``(1, C, 1, 1)`` tensor on ``device``."""
    return torch.as_tensor(values, dtype=torch.float32).view(1, -1, 1, 1).to(device)


def normalize_batch(
    images: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """uint8 ``(N, C, H, W)`` images to normalized float32: ``(x / 255 - mean) / std``.

    The trainer runs this on the training device (uint8 batches travel 4x lighter);
    :func:`eval_transform` applies the same arithmetic to single images.
    """
    mean_t = mean if isinstance(mean, torch.Tensor) else channel_stats(mean, images.device)
    std_t = std if isinstance(std, torch.Tensor) else channel_stats(std, images.device)
    return (images.to(torch.float32) / 255.0 - mean_t) / std_t


def eval_transform(config: dict[str, Any]) -> Callable[[Image.Image], torch.Tensor]:
    """The transform a model directory expects at inference: PIL RGB image -> normalized tensor."""
    image_size = int(config["image_size"])
    mean = [float(v) for v in config.get("mean", IMAGENET_MEAN)]
    std = [float(v) for v in config.get("std", IMAGENET_STD)]
    geometry = eval_geometry(image_size)

    def transform(image: Image.Image) -> torch.Tensor:
        return normalize_batch(geometry(image).unsqueeze(0), mean, std)[0]

    return transform


# --------------------------------------------------------------------------- writing


def plain_state_dict(model: nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU, contiguous, unshared copy of a state dict, without DDP's ``module.`` prefix."""
    if isinstance(model, nn.Module):
        inner = getattr(model, "module", model)  # unwrap DistributedDataParallel
        state = (inner if isinstance(inner, nn.Module) else model).state_dict()
    else:
        state = model
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key.removeprefix("module.")
        out[name] = value.detach().to("cpu", copy=True).contiguous()
    return out


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2, sort_keys=False, allow_nan=False)
        fh.write("\n")


def write_manifest(directory: str | Path, names: Iterable[str] = REQUIRED_FILES) -> None:
    folder = Path(directory)
    lines = [f"{sha256_file(folder / name)}  {name}\n" for name in sorted(names)]
    (folder / MANIFEST_FILE).write_text("".join(lines), encoding="utf-8")


def write_model_dir(
    dest: str | Path,
    model: nn.Module | dict[str, torch.Tensor],
    config: dict[str, Any],
    metrics: dict[str, Any],
    *,
    before_publish: Callable[[Path], None] | None = None,
    extra_files: dict[str, Path] | None = None,
) -> Path:
    """Write a complete model directory at ``dest`` atomically and return its path.

    ``model`` is a module (DDP-wrapped or not) or a state dict. Everything is written
    into a sibling ``<name>.tmp-*`` folder which is renamed to ``dest`` once complete,
    so a reader never sees a partial directory; an existing ``dest`` is replaced.
    ``config`` must name ``architecture``, ``classes`` and ``image_size``;
    ``format_version``, ``num_classes``, ``mean`` and ``std`` are filled in when absent.
    ``before_publish`` is called with the finished temporary folder just before the rename.
    ``extra_files`` (name -> file) are moved in beside the others and listed in the manifest
    (the ONNX export, ``model.onnx``).
    """
    dest = Path(dest)
    for key in ("architecture", "classes", "image_size"):
        if key not in config:
            raise ValueError(f"model config needs {key!r}")
    full_config: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "num_classes": len(config["classes"]),
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        **config,
    }
    if full_config["num_classes"] != len(full_config["classes"]):
        raise ValueError("num_classes does not match the number of class names")
    state = plain_state_dict(model)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{dest.name}.tmp-", dir=dest.parent))
    try:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(tmp / CONFIG_FILE, full_config)
        _write_json(tmp / METRICS_FILE, metrics)
        for name, source in (extra_files or {}).items():
            shutil.move(source, tmp / name)
        write_manifest(tmp, [*REQUIRED_FILES, *(extra_files or {})])
        os.chmod(tmp, 0o755)
        if before_publish is not None:
            before_publish(tmp)
        old: Path | None = None
        if dest.exists():
            old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


# --------------------------------------------------------------------------- ONNX and scripts

ONNX_OPSET = 17
ONNX_INPUT = "input"
ONNX_OUTPUT = "logits"


def export_onnx(model: nn.Module, example: torch.Tensor, dest: str | Path) -> None:
    """Export ``model`` (in eval mode) to ONNX at ``dest``: opset 17, input ``input``,
    output ``logits``, a dynamic batch dimension."""
    import warnings

    with warnings.catch_warnings():
        # The TorchScript-based exporter announces its deprecation; it is several times
        # faster than the dynamo one for these models and gives the same graph.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (example,),
            str(dest),
            input_names=[ONNX_INPUT],
            output_names=[ONNX_OUTPUT],
            dynamic_axes={ONNX_INPUT: {0: "batch"}, ONNX_OUTPUT: {0: "batch"}},
            opset_version=ONNX_OPSET,
            dynamo=False,
        )


def onnx_max_abs_diff(path: str | Path, model: nn.Module, batch: torch.Tensor) -> float:
    """The largest difference between ONNX Runtime's logits and torch's on ``batch`` and on
    its first image alone (proof the batch dimension is dynamic)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for inputs in (batch, batch[:1]):
        got = session.run(None, {ONNX_INPUT: inputs.numpy()})[0]
        with torch.inference_mode():
            want = model(inputs).float()
        worst = max(worst, float((torch.from_numpy(got) - want).abs().max()))
    return worst


def save_model_dir(
    dest: str | Path,
    model: nn.Module | dict[str, torch.Tensor],
    *,
    architecture: str,
    classes: Sequence[str],
    image_size: int,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    metrics: dict[str, Any] | None = None,
    example: torch.Tensor | None = None,
    onnx: bool = True,
    model_kwargs: dict[str, Any] | None = None,
) -> Path:
    """Write a model directory from your own training code, for instance from a script
    job into ``torchyard.run.output_dir() / "model"``, so that the folder can be
    registered as a model version (``torchyard model register NAME --job JOB --path model``)
    and scored, evaluated and downloaded like a training job's model.

    ``model`` is a torchvision classification model (``architecture`` as
    ``torchvision.models.get_model`` names it, its head sized for ``classes``; a
    DDP-wrapped module or a state dict will do); its weights must load into
    ``get_model(architecture, num_classes=len(classes))``. ``classes`` are the label
    names in output order, ``image_size``/``mean``/``std`` the evaluation geometry and
    normalization the service applies to images it scores (resize to
    ``image_size / 0.875``, centre crop ``image_size``, ``(x / 255 - mean) / std``).

    With ``onnx`` (the default) the model is exported to ONNX and the export checked
    against torch on ``example`` (a normalized ``(N, 3, S, S)`` batch; random images when
    not given); a difference over 1e-4 or a failed export raises ``RuntimeError``. The
    service scores models through their ONNX export, so keep it unless you only need
    the directory. The writing is atomic; an existing ``dest`` is replaced.
    """
    from torchyard.scoring import ONNX_FILE, ONNX_TOLERANCE

    config: dict[str, Any] = {
        "architecture": architecture,
        "classes": [str(c) for c in classes],
        "image_size": int(image_size),
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
    }
    if model_kwargs:
        config["model_kwargs"] = dict(model_kwargs)
    state = plain_state_dict(model)
    built = build_architecture({**config, "num_classes": len(config["classes"])})
    try:
        built.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(
            f"the weights do not load into torchvision's {architecture} with {len(classes)} classes: {exc}"
        ) from exc
    built.eval()
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.onnx-", dir=dest.parent))
    try:
        extra: dict[str, Path] = {}
        if onnx:
            if example is None:
                generator = torch.Generator().manual_seed(0)
                pixels = torch.randint(0, 256, (4, 3, image_size, image_size), generator=generator)
                example = normalize_batch(pixels.to(torch.uint8), config["mean"], config["std"])
            example = example.detach().to("cpu", torch.float32)
            export_onnx(built, example, work / ONNX_FILE)
            diff = onnx_max_abs_diff(work / ONNX_FILE, built, example)
            if diff > ONNX_TOLERANCE:
                raise RuntimeError(
                    f"the ONNX export's logits differ from torch's by {diff:.3g} (more than {ONNX_TOLERANCE:g})"
                )
            config["onnx"] = {
                "file": ONNX_FILE,
                "opset": ONNX_OPSET,
                "tolerance": ONNX_TOLERANCE,
                "max_abs_diff": diff,
                "check_batch": int(example.shape[0]),
            }
            extra[ONNX_FILE] = work / ONNX_FILE
        else:
            config["onnx"] = {"file": None, "opset": ONNX_OPSET, "tolerance": ONNX_TOLERANCE}
        return write_model_dir(dest, state, config, metrics or {}, extra_files=extra or None)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- reading


def read_config(path: str | Path) -> dict[str, Any]:
    """Parse and sanity-check ``config.json`` of a model directory."""
    folder = resolve_model_dir(path)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidModelDirectoryError(f"cannot read {CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidModelDirectoryError(f"{CONFIG_FILE} is not a JSON object")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise InvalidModelDirectoryError(f"unsupported model directory format_version {version!r}")
    classes = config.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise InvalidModelDirectoryError(f"{CONFIG_FILE} has no valid 'classes' list")
    if config.get("num_classes") != len(classes):
        raise InvalidModelDirectoryError(f"{CONFIG_FILE}: num_classes does not match the class list")
    if not isinstance(config.get("image_size"), int):
        raise InvalidModelDirectoryError(f"{CONFIG_FILE} has no integer 'image_size'")
    arch = config.get("architecture")
    if arch not in CLASSIFICATION_ARCHITECTURES:
        raise InvalidModelDirectoryError(f"{CONFIG_FILE} names an unknown architecture {arch!r}")
    return config


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a model directory (safetensors: nothing is unpickled)."""
    folder = resolve_model_dir(path)
    try:
        return load_file(str(folder / WEIGHTS_FILE), device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise InvalidModelDirectoryError(f"cannot read {WEIGHTS_FILE}: {exc}") from exc


def build_architecture(config: dict[str, Any]) -> nn.Module:
    """An untrained module shaped as the directory's config describes."""
    kwargs = dict(config.get("model_kwargs") or {})
    return torchvision.models.get_model(
        config["architecture"], weights=None, num_classes=int(config["num_classes"]), **kwargs
    )


def load_model(
    path: str | Path, device: str | torch.device = "cpu", *, verify: bool = True
) -> tuple[nn.Module, list[str], dict[str, Any]]:
    """Load a model directory: ``(module in eval mode, class names, config)``.

    The manifest is verified first (``verify=False`` skips it). Raises
    ``InvalidModelDirectoryError`` for anything missing, corrupt or inconsistent.
    """
    if verify:
        verify_model_dir(path)
    config = read_config(path)
    state = load_state(path)
    model = build_architecture(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise InvalidModelDirectoryError(f"weights do not match {config['architecture']}: {exc}") from exc
    model.to(device).eval()
    return model, list(config["classes"]), config


# --------------------------------------------------------------------------- inference


def _batches(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.inference_mode()
def _logits(
    model: nn.Module, config: dict[str, Any], paths: Sequence[str | Path], device: torch.device
) -> torch.Tensor:
    geometry = eval_geometry(int(config["image_size"]))
    mean, std = config.get("mean", IMAGENET_MEAN), config.get("std", IMAGENET_STD)
    images = torch.stack([geometry(load_rgb_image(p)) for p in paths]).to(device)
    return model(normalize_batch(images, mean, std)).float()


def usable_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device this machine has; a ``ValueError`` saying what is
    available otherwise (no traceback from deep inside torch)."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device {str(device)!r} is not a torch device (e.g. cpu, cuda, cuda:1): {exc}"
        ) from None
    if found.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device {str(device)!r}: this machine has no CUDA GPU that torch can use; use cpu"
            )
        if found.index is not None and found.index >= count:
            raise ValueError(
                f"device {str(device)!r}: this machine has {count} CUDA GPU(s): cuda:0..cuda:{count - 1}"
            )
    elif found.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r}: MPS is not available here; use cpu")
    return found


def predict(
    path: str | Path,
    image_paths: Sequence[str | Path],
    topk: int = 5,
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 64,
) -> list[list[tuple[str, float]]]:
    """Classify images with a model directory: per image, the ``topk`` ``(class, probability)``."""
    device = usable_device(device)
    model, classes, config = load_model(path, device)
    k = max(1, min(topk, len(classes)))
    results: list[list[tuple[str, float]]] = []
    for chunk in _batches(list(image_paths), batch_size):
        probs = _logits(model, config, chunk, torch.device(device)).softmax(dim=1)
        values, indices = probs.topk(k, dim=1)
        for row_v, row_i in zip(values.tolist(), indices.tolist(), strict=True):
            results.append([(classes[i], float(v)) for v, i in zip(row_v, row_i, strict=True)])
    return results


def evaluate_dir(
    path: str | Path,
    image_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 64,
) -> dict[str, Any]:
    """Top-1 accuracy of a model directory over a labeled ImageDirectory.

    Returns ``{"top1": fraction, "correct": int, "n": int}``; the dataset's class
    folders must be the model's classes.
    """
    model, classes, config = load_model(path, device)
    samples = image_directory_samples(image_dir, classes)
    correct = 0
    for chunk in _batches(samples, batch_size):
        logits = _logits(model, config, [p for p, _ in chunk], torch.device(device))
        targets = torch.tensor([t for _, t in chunk], device=logits.device)
        correct += int((logits.argmax(dim=1) == targets).sum().item())
    return {"top1": correct / len(samples), "correct": correct, "n": len(samples)}
