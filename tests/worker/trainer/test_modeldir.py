"""Model directories (writer, manifest, loader, predict) and model building (head re-sizing, errors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision

from tests.support.trainer_helpers import DIGIT_CLASSES, Digits, write_job
from torchyard import modeldir
from torchyard.contract.errors import InvalidModelDirectoryError
from worker.trainer.config import load_job
from worker.trainer.models import build_model, pretrained_cache_file, resize_head


def _model_dir(
    dest: Path, classes: list[str], arch: str = "resnet18", seed: int = 0
) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torchvision.models.get_model(arch, weights=None, num_classes=len(classes))
    config = {"architecture": arch, "classes": classes, "image_size": 32}
    modeldir.write_model_dir(dest, model, config, {"best_epoch": 1})
    return dest, model


def _layer(model: torch.nn.Module, name: str) -> Any:
    return model.get_submodule(name)


def test_model_dir_layout_and_manifest(tmp_path: Path) -> None:
    path, _ = _model_dir(tmp_path / "model", ["a", "b", "c"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folder left
    assert sorted(p.name for p in path.iterdir()) == [
        "SHA256SUMS",
        "config.json",
        "metrics.json",
        "model.safetensors",
    ]
    config = json.loads((path / "config.json").read_text())
    assert config["format_version"] == 1 and config["num_classes"] == 3
    assert config["mean"] == list(modeldir.IMAGENET_MEAN) and config["std"] == list(modeldir.IMAGENET_STD)
    lines = (path / "SHA256SUMS").read_text().splitlines()
    assert [line.split("  ")[1] for line in lines] == ["config.json", "metrics.json", "model.safetensors"]
    modeldir.verify_model_dir(path)


def test_tampered_or_incomplete_model_dir_is_rejected(tmp_path: Path) -> None:
    path, _ = _model_dir(tmp_path / "model", ["a", "b"])
    (path / "metrics.json").write_text("{}")
    with pytest.raises(InvalidModelDirectoryError, match=r"checksum mismatch for metrics\.json"):
        modeldir.verify_model_dir(path)
    other, _ = _model_dir(tmp_path / "other", ["a", "b"])
    (other / "model.safetensors").unlink()
    with pytest.raises(InvalidModelDirectoryError, match=r"missing model\.safetensors"):
        modeldir.load_model(other)
    (path / "SHA256SUMS").unlink()
    with pytest.raises(InvalidModelDirectoryError, match="no SHA256SUMS"):
        modeldir.verify_model_dir(path)
    with pytest.raises(InvalidModelDirectoryError):
        modeldir.load_model(tmp_path / "nowhere")


def test_load_model_reproduces_the_module_without_ddp_prefix(tmp_path: Path) -> None:
    classes = ["x", "y", "z", "w"]
    torch.manual_seed(1)
    model = torchvision.models.get_model("resnet18", weights=None, num_classes=4).eval()
    prefixed = {f"module.{k}": v for k, v in model.state_dict().items()}  # as a DDP wrapper names them
    path = modeldir.write_model_dir(
        tmp_path / "m", prefixed, {"architecture": "resnet18", "classes": classes, "image_size": 32}, {}
    )
    loaded, names, config = modeldir.load_model(path)
    assert names == classes and config["architecture"] == "resnet18" and not loaded.training
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    # A download extracted with a wrapping folder loads as well.
    wrapped = tmp_path / "download"
    wrapped.mkdir()
    path.rename(wrapped / "model")
    modeldir.verify_model_dir(wrapped)


def test_predict_and_evaluate_dir(tmp_path: Path, digits: Digits) -> None:
    path, _ = _model_dir(tmp_path / "model", DIGIT_CLASSES)
    images = sorted((digits.val / "3").iterdir())[:2]
    results = modeldir.predict(path, images, topk=3)
    assert len(results) == 2 and all(len(r) == 3 for r in results)
    assert all(name in DIGIT_CLASSES and 0 <= p <= 1 for r in results for name, p in r)
    assert results[0][0][1] >= results[0][1][1]
    report = modeldir.evaluate_dir(path, digits.val)
    assert report["n"] == 60 and 0 <= report["top1"] <= 1


@pytest.mark.parametrize(
    ("arch", "head"),
    [
        ("resnet18", "fc"),
        ("squeezenet1_1", "classifier.1"),
        ("mobilenet_v3_small", "classifier.3"),
        ("densenet121", "classifier"),
    ],
)
def test_resize_head_finds_the_classifier(arch: str, head: str) -> None:
    model = torchvision.models.get_model(arch, weights=None, num_classes=10)
    assert resize_head(model, 10, 3) == [head]
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


def test_resize_head_includes_auxiliary_heads() -> None:
    model = torchvision.models.get_model("googlenet", weights=None, num_classes=10, init_weights=False)
    assert resize_head(model, 10, 4) == ["fc", "aux1.fc2", "aux2.fc2"]


def test_unknown_architecture(tmp_path: Path, digits: Digits) -> None:
    job = load_job(write_job(tmp_path, digits, architecture="resnet19"))
    with pytest.raises(InvalidModelDirectoryError, match="unknown architecture 'resnet19'"):
        build_model(job)


def test_pretrained_weights_must_be_in_the_offline_cache(
    tmp_path: Path,
    digits: Digits,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.hub, "_hub_dir", None)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty-torch-home"))
    job = load_job(write_job(tmp_path / "run", digits, pretrained=True))
    assert not pretrained_cache_file("resnet18").exists()
    with pytest.raises(InvalidModelDirectoryError, match="not in the offline torch hub cache"):
        build_model(job)
    assert not (tmp_path / "empty-torch-home").exists()  # nothing was downloaded


def test_pretrained_weights_from_the_cache_get_a_new_head(
    tmp_path: Path,
    digits: Digits,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.hub, "_hub_dir", None)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    cache = pretrained_cache_file("squeezenet1_1")
    cache.parent.mkdir(parents=True)
    torch.manual_seed(3)
    imagenet = torchvision.models.get_model("squeezenet1_1", weights=None)  # stands in for the real weights
    torch.save(imagenet.state_dict(), cache)
    job = load_job(write_job(tmp_path / "run", digits, architecture="squeezenet1_1", pretrained=True))

    built = build_model(job)
    assert built.initialized_from == f"pretrained:{cache.name}"
    assert _layer(built.module, "classifier.1").out_channels == 10
    assert torch.equal(_layer(built.module, "features.0").weight, _layer(imagenet, "features.0").weight)

    cache.write_bytes(b"truncated download")
    with pytest.raises(InvalidModelDirectoryError, match="cannot load the cached pretrained weights"):
        build_model(job)


def test_init_from_dir_resizes_the_head_for_other_classes(tmp_path: Path, digits: Digits) -> None:
    source, trained = _model_dir(tmp_path / "previous", ["cat", "dog", "emu", "fox", "gnu"], seed=5)
    job = load_job(write_job(tmp_path / "run", digits, init_from_dir=source))  # 10 digit classes
    built = build_model(job)
    assert _layer(built.module, "fc").out_features == 10
    assert torch.equal(_layer(built.module, "conv1").weight, _layer(trained, "conv1").weight)
    assert built.initialized_from == "init_from:" + modeldir.sha256_file(source / "model.safetensors")


def test_init_from_dir_keeps_the_head_for_the_same_classes(tmp_path: Path, digits: Digits) -> None:
    source, trained = _model_dir(tmp_path / "previous", DIGIT_CLASSES, seed=6)
    built = build_model(load_job(write_job(tmp_path / "run", digits, init_from_dir=source)))
    assert torch.equal(_layer(built.module, "fc").weight, _layer(trained, "fc").weight)


def test_init_from_dir_errors(tmp_path: Path, digits: Digits) -> None:
    source, _ = _model_dir(tmp_path / "previous", DIGIT_CLASSES)
    job = load_job(write_job(tmp_path / "run", digits, architecture="resnet34", init_from_dir=source))
    with pytest.raises(InvalidModelDirectoryError, match="is a resnet18"):
        build_model(job)
    (source / "config.json").write_text("{}")
    job = load_job(write_job(tmp_path / "run2", digits, init_from_dir=source))
    with pytest.raises(InvalidModelDirectoryError, match="checksum mismatch"):
        build_model(job)


def test_image_size_below_the_architecture_minimum(tmp_path: Path, digits: Digits) -> None:
    job = load_job(write_job(tmp_path, digits, architecture="inception_v3", image_size=64))
    with pytest.raises(InvalidModelDirectoryError, match=r"inception_v3 needs image_size >= 75"):
        build_model(job)


def test_save_model_dir_writes_a_checked_onnx_export_and_refuses_wrong_weights(tmp_path: Path) -> None:
    """A script's own model (a replaced head, as examples/finetune-resnet does) becomes a model
    directory the registry accepts: the loader and ONNX Runtime agree on it."""
    from torchyard.contract.model_archive import check_model_config, pack_model_dir
    from torchyard.scoring import OnnxModel

    torch.manual_seed(0)
    model = torchvision.models.get_model("resnet18", weights=None)
    model.fc = torch.nn.Linear(model.fc.in_features, 3)
    path = modeldir.save_model_dir(
        tmp_path / "model", model, architecture="resnet18", classes=["a", "b", "c"], image_size=32
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folder left
    modeldir.verify_model_dir(path)
    config = json.loads((path / "config.json").read_text())
    check_model_config(config, [p.name for p in path.iterdir()])
    assert config["onnx"]["file"] == "model.onnx" and config["onnx"]["max_abs_diff"] <= 1e-4
    pack_model_dir(path, tmp_path / "model.tar.gz")  # the manifest lists model.onnx too
    loaded, classes, _ = modeldir.load_model(path)
    inputs = modeldir.normalize_batch(
        torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8), config["mean"], config["std"]
    )
    with torch.inference_mode():
        want = loaded(inputs).numpy()
    got = OnnxModel.load(path).logits(inputs.numpy())
    assert classes == ["a", "b", "c"] and abs(got - want).max() <= 1e-4

    with pytest.raises(ValueError, match="do not load into torchvision's resnet18 with 4 classes"):
        modeldir.save_model_dir(
            tmp_path / "bad", model, architecture="resnet18", classes=list("abcd"), image_size=32
        )
    assert not (tmp_path / "bad").exists()
