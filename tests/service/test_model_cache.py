"""The API's cache of loaded ONNX models: least recently used first out, bounded by count
and by the bytes of the ONNX files, on real exports run by ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from torchyard.modeldir import export_onnx
from torchyard.scoring import CONFIG_FILE, ONNX_FILE, ModelCache, OnnxModel

IMAGE_SIZE = 16
CLASSES = ["cat", "dog", "fox"]


def _export(folder: Path, hidden: int) -> Path:
    """A model directory holding a small classifier's ONNX export; ``hidden`` sets its size."""
    torch.manual_seed(hidden)
    model = nn.Sequential(
        nn.Conv2d(3, hidden, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, len(CLASSES)),
    ).eval()
    folder.mkdir(parents=True)
    export_onnx(model, torch.zeros(1, 3, IMAGE_SIZE, IMAGE_SIZE), folder / ONNX_FILE)
    config = {"classes": CLASSES, "image_size": IMAGE_SIZE}
    (folder / CONFIG_FILE).write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    made = {name: _export(root / name, hidden) for name, hidden in {"a": 8, "b": 9, "c": 10}.items()}
    made["big"] = _export(root / "big", 200)
    return made


def _size(folder: Path) -> int:
    return (folder / ONNX_FILE).stat().st_size


def test_a_cached_model_is_loaded_once_and_scores(folders: dict[str, Path]) -> None:
    cache = ModelCache(max_models=4, max_bytes=10**9)
    first = cache.get("a", folders["a"])
    assert cache.get("a", folders["a"]) is first
    assert first.size_bytes == _size(folders["a"]) and first.classes == CLASSES
    top = first.predict([Image.new("RGB", (40, 24), (200, 30, 30))], k=2)
    assert len(top) == 1 and len(top[0]) == 2 and {label for label, _ in top[0]} <= set(CLASSES)


def test_eviction_by_count_drops_the_least_recently_used(folders: dict[str, Path]) -> None:
    cache = ModelCache(max_models=2, max_bytes=10**9)
    a = cache.get("a", folders["a"])
    b = cache.get("b", folders["b"])
    assert cache.keys() == ["a", "b"]
    # using a makes b the least recently used: c pushes b out, not a
    assert cache.get("a", folders["a"]) is a
    c = cache.get("c", folders["c"])
    assert cache.keys() == ["a", "c"]
    assert cache.get("a", folders["a"]) is a and cache.get("c", folders["c"]) is c
    # b was dropped: asking again loads it afresh, and now pushes out a (the older of a, c)
    assert cache.get("a", folders["a"]) is a  # order: c, a
    b_again = cache.get("b", folders["b"])
    assert b_again is not b and cache.keys() == ["a", "b"]


def test_eviction_by_bytes_keeps_the_total_within_the_budget(folders: dict[str, Path]) -> None:
    small = [_size(folders[name]) for name in ("a", "b", "c")]
    big = _size(folders["big"])
    assert big > sum(small), "the big export must outweigh the small ones together"
    # room for a and b, not for c as well
    cache = ModelCache(max_models=10, max_bytes=small[0] + small[1] + small[2] - 1)
    a = cache.get("a", folders["a"])
    cache.get("b", folders["b"])
    cache.get("a", folders["a"])  # b is now the least recently used
    cache.get("c", folders["c"])
    assert cache.keys() == ["a", "c"]
    assert cache.get("a", folders["a"]) is a
    # a model over the whole budget on its own pushes every other out and stays, alone
    loaded = cache.get("big", folders["big"])
    assert cache.keys() == ["big"] and cache.get("big", folders["big"]) is loaded
    # the next small one pushes the big one out: the two together are over the budget
    cache.get("a", folders["a"])
    assert cache.keys() == ["a"]


def test_discard_forgets_a_model_by_key_prefix(folders: dict[str, Path]) -> None:
    cache = ModelCache(max_models=4, max_bytes=10**9)
    first = cache.get("v1:a", folders["a"])
    cache.get("v2:b", folders["b"])
    cache.discard("v1:")
    assert cache.keys() == ["v2:b"]
    assert cache.get("v1:a", folders["a"]) is not first


def test_onnx_model_loads_the_directory_preprocessing(folders: dict[str, Path]) -> None:
    """Without mean and std in config.json the ImageNet ones apply; the crop is the model's size."""
    model = OnnxModel.load(folders["a"])
    assert model.image_size == IMAGE_SIZE and model.mean == pytest.approx([0.485, 0.456, 0.406])
    assert model.geometry(Image.new("RGB", (50, 20))).shape == (3, IMAGE_SIZE, IMAGE_SIZE)
