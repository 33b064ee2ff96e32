"""Building the network: torchvision architectures, pretrained weights (stored or torch hub), fine-tuning."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn

from torchyard import modeldir
from torchyard.contract.errors import InvalidModelDirectoryError
from worker.trainer.config import JobConfig

log = logging.getLogger(__name__)


def available_architectures() -> list[str]:
    return list(torchvision.models.list_models(module=torchvision.models))


@dataclass
class BuiltModel:
    module: nn.Module
    # Architecture arguments besides num_classes, recorded in config.json for the loader.
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    # Provenance of the initial weights: "scratch", "pretrained:<file>" or "init_from:<sha256>".
    initialized_from: str = "scratch"


def pretrained_cache_file(architecture: str) -> Path:
    """Where torch hub keeps the default pretrained weights of ``architecture``."""
    weights = torchvision.models.get_model_weights(architecture).DEFAULT
    filename = os.path.basename(urlparse(weights.url).path)
    return Path(torch.hub.get_dir()) / "checkpoints" / filename


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Force ``torch.load(weights_only=True)`` for code that does not pass it (torch hub)."""
    saved = {
        k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    }
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _classifier_heads(model: nn.Module, num_outputs: int) -> list[str]:
    """Qualified names of the output layers producing ``num_outputs`` logits.

    The main head is the last ``Linear``/``Conv2d`` (SqueezeNet's head is a 1x1
    convolution) in registration order with that many outputs: resnet ``fc``,
    densenet/vgg/efficientnet ``classifier...``, vit ``heads.head``... Auxiliary heads
    (inception ``AuxLogits.fc``, googlenet ``aux1.fc2``) are included.
    """
    candidates = [
        name
        for name, module in model.named_modules()
        if (isinstance(module, nn.Linear) and module.out_features == num_outputs)
        or (isinstance(module, nn.Conv2d) and module.out_channels == num_outputs)
    ]
    main = [n for n in candidates if "aux" not in n.lower()]
    if not main:
        raise InvalidModelDirectoryError(
            f"cannot find the classifier layer ({num_outputs} outputs) of the model"
        )
    aux_roots = {n.split(".")[0] for n in candidates if "aux" in n.lower()}
    aux = [
        max((n for n in candidates if n.split(".")[0] == root), key=candidates.index)
        for root in sorted(aux_roots)
    ]
    return [main[-1], *aux]


def _replace_layer(model: nn.Module, name: str, num_outputs: int) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = model.get_submodule(name)
    new: nn.Module
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_outputs, bias=old.bias is not None)
    elif isinstance(old, nn.Conv2d):
        kernel = cast(tuple[int, int], old.kernel_size)
        stride = cast(tuple[int, int], old.stride)
        padding = cast(tuple[int, int], old.padding)
        new = nn.Conv2d(
            old.in_channels,
            num_outputs,
            kernel_size=kernel,
            stride=stride,
            padding=padding,
            bias=old.bias is not None,
        )
    else:  # pragma: no cover - _classifier_heads only returns the two types above
        raise TypeError(type(old).__name__)
    new.to(device=next(old.parameters()).device, dtype=next(old.parameters()).dtype)
    setattr(parent, attr, new)


def resize_head(model: nn.Module, old_num_classes: int, new_num_classes: int) -> list[str]:
    """Replace the classifier layer(s) with freshly initialised ones for ``new_num_classes``.

    Returns the names of the replaced layers. The rest of the network keeps its weights.
    """
    names = _classifier_heads(model, old_num_classes)
    for name in names:
        _replace_layer(model, name, new_num_classes)
    if isinstance(getattr(model, "num_classes", None), int):
        setattr(model, "num_classes", new_num_classes)  # noqa: B010 - plain attribute, not a submodule
    return names


def _min_image_size(architecture: str) -> int:
    """Smallest input the architecture accepts (torchvision's ``min_size`` metadata).

    Vision transformers are sized to the job's ``image_size`` when trained from scratch.
    """
    if architecture.startswith("vit_"):
        return 0
    weights = torchvision.models.get_model_weights(architecture).DEFAULT
    return int(weights.meta.get("min_size", (0, 0))[0])


def _architecture_kwargs(
    architecture: str, image_size: int, pretrained: bool, memory_efficient: bool
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if architecture.startswith("densenet"):
        kwargs["memory_efficient"] = memory_efficient
    elif memory_efficient:
        log.warning("memory_efficient only applies to DenseNet; ignored for %s", architecture)
    if architecture.startswith("vit_") and not pretrained:
        # Vision transformers are built for one input size; size them for the job's.
        kwargs["image_size"] = image_size
    return kwargs


def _shape_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs that change parameter shapes (what a loader must repeat)."""
    return {k: v for k, v in kwargs.items() if k != "memory_efficient"}


def build_model(job: JobConfig) -> BuiltModel:
    """The job's network with ``len(job.classes)`` outputs, on the CPU.

    - scratch: ``torchvision.models.get_model(name, weights=None, num_classes=...)``;
    - ``pretrained``: the weights file the agent fetched from the service's weights store
      (``model.weights_file``), else the default weights from the torch hub cache (which the
      agent fills on nodes that may download them; the trainer itself never downloads),
      head re-sized to the job's classes;
    - ``init_from_dir``: a verified model directory of an earlier job; its head is kept
      when the class list is the same and re-initialised otherwise.

    Raises ``InvalidModelDirectoryError`` for an unknown architecture, missing cached
    weights or an unusable model directory.
    """
    spec = job.model
    arch = spec.architecture
    if arch not in available_architectures():
        raise InvalidModelDirectoryError(
            f"unknown architecture {arch!r}; choose one of torchvision's classification models "
            f"(e.g. resnet18, resnet50, densenet121)"
        )
    num_classes = job.num_classes
    image_size = job.parameters.image_size
    smallest = _min_image_size(arch)
    if image_size < smallest:
        raise InvalidModelDirectoryError(f"{arch} needs image_size >= {smallest}, not {image_size}")
    if job.init_from_dir:
        return _from_model_dir(job, Path(job.init_from_dir))

    kwargs = _architecture_kwargs(arch, image_size, spec.pretrained, spec.memory_efficient)
    if not spec.pretrained:
        module = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
        return BuiltModel(module, _shape_kwargs(kwargs))

    weights = torchvision.models.get_model_weights(arch).DEFAULT
    native_size = weights.meta.get("min_size", (0, 0))[0]
    if arch.startswith(("vit_", "maxvit_")) and image_size != native_size:
        raise InvalidModelDirectoryError(
            f"pretrained {arch} only accepts image_size {native_size}, not {image_size}"
        )
    if spec.weights_file:
        return _from_state_dict(job, Path(spec.weights_file), kwargs)
    return _from_hub_cache(job, kwargs)


def _ways_to_add_weights(arch: str) -> str:
    """The two ways to give a pretrained job its weights (docs/fine-tuning.md)."""
    return (
        f"add weights for {arch} in one of two ways: upload them to the weights store with "
        f"'torchyard weights upload {arch} FILE', or let the nodes download them from the torch hub "
        "(TORCHYARD_WORKER_PRETRAINED_FROM_HUB=1 on the workers); or train with pretrained=false"
    )


def _from_hub_cache(job: JobConfig, kwargs: dict[str, Any]) -> BuiltModel:
    """The default weights from the torch hub cache (never downloaded here), head re-sized."""
    arch = job.model.architecture
    num_classes = job.num_classes
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    cache_file = pretrained_cache_file(arch)
    if not cache_file.is_file():
        raise InvalidModelDirectoryError(
            f"pretrained weights for {arch} are not in the offline torch hub cache "
            f"(expected checkpoints/{cache_file.name} under the TORCH_HOME hub directory) and the job "
            f"has none from the service's weights store: {_ways_to_add_weights(arch)}"
        )
    try:
        with _weights_only_loads():
            module = torchvision.models.get_model(arch, weights=weights, progress=False, **kwargs)
    except Exception as exc:  # a damaged cache file fails in many ways inside torch.load
        raise InvalidModelDirectoryError(
            f"cannot load the cached pretrained weights of {arch} ({cache_file.name} in the torch hub "
            f"cache): {type(exc).__name__}: {exc}; remove that file, then {_ways_to_add_weights(arch)}"
        ) from exc
    pretrained_classes = len(weights.meta["categories"])
    if pretrained_classes != num_classes:
        replaced = resize_head(module, pretrained_classes, num_classes)
        log.info("pretrained %s: re-initialised %s for %d classes", arch, ", ".join(replaced), num_classes)
    shape_kwargs = _shape_kwargs(kwargs)
    if arch.startswith("vit_"):
        shape_kwargs["image_size"] = weights.meta["min_size"][0]
    return BuiltModel(module, shape_kwargs, initialized_from=f"pretrained:{cache_file.name}")


def _from_state_dict(job: JobConfig, path: Path, kwargs: dict[str, Any]) -> BuiltModel:
    """The architecture with a state dict from the weights store (torchvision's default
    number of classes), its head re-initialised for the job's classes (fine-tuning)."""
    arch = job.model.architecture
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    stored_classes = len(weights.meta["categories"])
    shape_kwargs = _shape_kwargs(kwargs)
    if arch.startswith("vit_"):
        shape_kwargs["image_size"] = weights.meta["min_size"][0]
    module = torchvision.models.get_model(arch, weights=None, num_classes=stored_classes, **kwargs)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign file fails in many ways inside torch.load
        raise InvalidModelDirectoryError(
            f"cannot read the stored pretrained weights of {arch} ({path.name}): {type(exc).__name__}: {exc}; "
            f"{_ways_to_add_weights(arch)}"
        ) from exc
    if not isinstance(state, dict):
        raise InvalidModelDirectoryError(
            f"the stored pretrained weights of {arch} are a {type(state).__name__}, not a state dict"
        )
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise InvalidModelDirectoryError(
            f"the stored pretrained weights do not fit {arch} with {stored_classes} classes: {exc}"
        ) from exc
    sha = path.stem
    log.info("pretrained %s: starting from the stored weights (sha256 %s)", arch, sha)
    if stored_classes != job.num_classes:
        replaced = resize_head(module, stored_classes, job.num_classes)
        log.info(
            "pretrained %s: re-initialised %s for %d classes", arch, ", ".join(replaced), job.num_classes
        )
    return BuiltModel(module, shape_kwargs, initialized_from=f"pretrained:{sha}")


def _from_model_dir(job: JobConfig, directory: Path) -> BuiltModel:
    modeldir.verify_model_dir(directory)
    config = modeldir.read_config(directory)
    arch = job.model.architecture
    if config["architecture"] != arch:
        raise InvalidModelDirectoryError(
            f"init_from model is a {config['architecture']}, but the job trains a {arch}"
        )
    if job.model.pretrained:
        log.warning("pretrained is ignored: the weights come from the init_from model directory")
    kwargs = dict(config.get("model_kwargs") or {})
    if arch.startswith("densenet"):
        kwargs["memory_efficient"] = job.model.memory_efficient
    state = modeldir.load_state(directory)
    module = torchvision.models.get_model(
        arch, weights=None, num_classes=int(config["num_classes"]), **kwargs
    )
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise InvalidModelDirectoryError(f"init_from weights do not fit {arch}: {exc}") from exc
    if list(config["classes"]) != list(job.classes):
        replaced = resize_head(module, int(config["num_classes"]), job.num_classes)
        log.info(
            "init_from: classes differ (%d -> %d); re-initialised %s",
            config["num_classes"],
            job.num_classes,
            ", ".join(replaced),
        )
    weights_sha = modeldir.sha256_file(modeldir.resolve_model_dir(directory) / modeldir.WEIGHTS_FILE)
    return BuiltModel(module, _shape_kwargs(kwargs), initialized_from=f"init_from:{weights_sha}")
