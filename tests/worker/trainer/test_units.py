"""Unit tests of the trainer's pieces: early stopping, sharding, job.json, data, failures, checkpoints."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.support.trainer_helpers import DIGIT_CLASSES, Digits
from torchyard.contract.errors import InvalidDatasetError, RankFailedError, TrainingDivergedError
from torchyard.modeldir import image_directory_classes, image_directory_samples
from worker.trainer import checkpoint as ckpt
from worker.trainer.config import load_job
from worker.trainer.data import ImageDataset, default_loader_workers, shard_indices, train_transform
from worker.trainer.early_stopping import EarlyStopping
from worker.trainer.events import EventWriter
from worker.trainer.failure import classify, failure_record, write_failure
from worker.trainer.loop import LossMeter
from worker.trainer.seeding import derive_seed

# ---------------------------------------------------------------- early stopping


def test_early_stopping_counts_epochs_without_a_lower_loss() -> None:
    stopper = EarlyStopping(patience=2)
    assert stopper.update(1.0, 1)
    assert not stopper.update(1.2, 2)
    assert not stopper.should_stop
    assert stopper.update(0.9, 3)  # a new best resets the count
    assert not stopper.update(0.9, 4)  # equal is not lower
    assert not stopper.update(1.5, 5)
    assert stopper.should_stop
    assert (stopper.best_loss, stopper.best_epoch) == (0.9, 3)


def test_early_stopping_state_round_trip() -> None:
    stopper = EarlyStopping(patience=3)
    stopper.update(2.0, 1)
    stopper.update(2.5, 2)
    other = EarlyStopping(patience=3)
    other.load_state_dict(stopper.state_dict())
    assert other == stopper


# ---------------------------------------------------------------- validation sharding


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 10, 13, 60])
def test_validation_shards_cover_every_index_exactly_once(world_size: int, n: int) -> None:
    shards = [shard_indices(n, rank, world_size) for rank in range(world_size)]
    seen = sorted(i for shard in shards for i in shard)
    assert seen == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


# ---------------------------------------------------------------- job.json


def test_job_defaults_and_unknown_fields(tmp_path: Path) -> None:
    raw = {
        "job_id": "j",
        "model": {"architecture": "resnet18"},
        "train_dir": "t",
        "val_dir": "v",
        "classes": ["a", "b"],
        "output_dir": str(tmp_path),
        "future_field": 1,
        "parameters": {"epochs": 3},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(raw))
    job = load_job(path)
    p = job.parameters
    assert (p.epochs, p.batch_size, p.learning_rate, p.patience, p.image_size, p.augmentation) == (
        3,
        16,
        0.001,
        3,
        224,
        "standard",
    )
    assert job.unknown_fields() == ["future_field"]
    assert job.loader_workers is None and job.init_from_dir is None


def test_the_logged_job_summary_is_readable_and_names_no_node_path(tmp_path: Path) -> None:
    raw = {
        "job_id": "j",
        "model": {"architecture": "resnet18"},
        "train_dir": str(tmp_path / "cache" / "train"),
        "val_dir": str(tmp_path / "cache" / "val"),
        "classes": [str(i) for i in range(10)],
        "datasets": {"train": {"id": "d-train"}, "validation": {"id": "d-val"}},
        "output_dir": str(tmp_path / "run"),
        "task": "train",
        "parameters": {"epochs": 3, "learning_rate": 0.017439263563117445},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(raw))
    summary = load_job(path).summary()
    assert summary.splitlines()[0] == "train a resnet18 on 10 classes (0, 1, 2, 3, 4, … (10 in all))"
    assert "datasets: training d-train, validation d-val" in summary
    assert (
        "epochs 3" in summary and "learning_rate 0.0174393" in summary and "augmentation standard" in summary
    )
    assert str(tmp_path) not in summary and "TrainerTask" not in summary and "{" not in summary


@pytest.mark.parametrize(
    "parameters",
    [{"warmup_epochs": 6, "epochs": 5}, {"learning_rate": 0}, {"image_size": 8}, {"augmentation": "heavy"}],
)
def test_invalid_job_is_rejected(tmp_path: Path, parameters: dict[str, object]) -> None:
    raw = {
        "job_id": "j",
        "model": {"architecture": "resnet18"},
        "train_dir": "t",
        "val_dir": "v",
        "classes": ["a"],
        "output_dir": str(tmp_path),
        "parameters": parameters,
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(RankFailedError, match="invalid job configuration"):
        load_job(path)


# ---------------------------------------------------------------- ImageDirectory


def _png(path: Path, value: int = 128) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (10, 10), value).save(path)


def test_wrapped_dataset_with_archive_litter(tmp_path: Path) -> None:
    root = tmp_path / "upload"
    _png(root / "digits" / "cat" / "a.png")
    _png(root / "digits" / "cat" / "nested" / "b.PNG")
    _png(root / "digits" / "dog" / "c.png")
    _png(root / "digits" / "dog" / ".hidden.png")
    (root / "digits" / "dog" / "notes.txt").write_text("not an image")
    _png(root / "__MACOSX" / "digits" / "cat" / "._a.png")
    (root / ".DS_Store").write_text("")
    assert image_directory_classes(root) == ["cat", "dog"]
    samples = image_directory_samples(root, ["cat", "dog"])
    assert [(Path(p).name, t) for p, t in samples] == [("a.png", 0), ("b.PNG", 0), ("c.png", 1)]


def test_dataset_must_have_the_job_classes(tmp_path: Path) -> None:
    _png(tmp_path / "a" / "x.png")
    _png(tmp_path / "c" / "y.png")
    with pytest.raises(
        InvalidDatasetError, match=r"missing class folders \['b'\].*unexpected class folders \['c'\]"
    ):
        image_directory_samples(tmp_path, ["a", "b"])


def test_corrupt_image_is_a_dataset_error(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "broken.jpg").write_bytes(b"not a jpeg")
    dataset = ImageDataset(image_directory_samples(tmp_path, ["a"]), train_transform(16, "standard"))
    with pytest.raises(InvalidDatasetError, match=r"broken\.jpg"):
        dataset[0]


@pytest.mark.parametrize("augmentation", ["standard", "light", "none"])
def test_train_transform_outputs_uint8_crops(digits: Digits, augmentation: str) -> None:
    samples = image_directory_samples(digits.train, DIGIT_CLASSES)
    image, target = ImageDataset(samples, train_transform(24, augmentation))[0]  # type: ignore[arg-type]
    assert image.dtype == torch.uint8 and image.shape == (3, 24, 24)
    assert target == 0


def test_loader_workers_stay_modest_on_cpu() -> None:
    assert 0 <= default_loader_workers(torch.device("cpu"), 2) <= 2


def test_derived_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(1, "epoch", 1, 0) == derive_seed(1, "epoch", 1, 0)
    assert derive_seed(1, "epoch", 1, 0) != derive_seed(1, "epoch", 1, 1)
    assert 0 <= derive_seed(-(2**63), "init") < 2**62


# ---------------------------------------------------------------- divergence and failure files


def test_non_finite_loss_raises_diverged_with_the_learning_rate() -> None:
    meter = LossMeter(torch.device("cpu"), learning_rate=0.5, effective_lr=1.0)
    meter.push(torch.tensor(2.0), epoch=1, step=1)
    with pytest.raises(TrainingDivergedError, match=r"Lower the learning rate: learning_rate is 0.5") as info:
        meter.push(torch.tensor(math.nan), epoch=1, step=2)
    assert "try 0.05" in info.value.message
    assert meter.take_epoch() == (2.0, 1)


def test_failure_codes() -> None:
    assert classify(TrainingDivergedError("x"))[0] == "TrainingDivergedError"
    assert classify(InvalidDatasetError("bad"))[0] == "InvalidDatasetError"
    assert classify(RuntimeError("boom")) == ("RankFailedError", "RuntimeError: boom")
    wrapped = InvalidDatasetError(
        "Caught InvalidDatasetError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        "  File \"x.py\", line 1\ntorchyard.contract.errors.InvalidDatasetError: cannot read image 'a.png'\n"
    )
    assert classify(wrapped) == ("InvalidDatasetError", "cannot read image 'a.png'")


def test_failure_file_is_complete(tmp_path: Path) -> None:
    try:
        raise ValueError("bad value")
    except ValueError as exc:
        record = failure_record(exc, rank=3, local_rank=1, node="node-a")
    path = write_failure(tmp_path, record)
    assert path.name == "failure-rank-3.json"
    data = json.loads(path.read_text())
    assert data["code"] == "RankFailedError" and data["message"] == "ValueError: bad value"
    assert (data["rank"], data["local_rank"], data["node"], data["secondary"]) == (3, 1, "node-a", False)
    assert "raise ValueError" in data["traceback"]
    assert [p.name for p in tmp_path.iterdir()] == ["failure-rank-3.json"]


# ---------------------------------------------------------------- checkpoint and events


def test_checkpoint_round_trip_with_weights_only(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {
        "job_id": "j",
        "architecture": "resnet18",
        "classes": ["a", "b"],
        "epoch": 2,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "history": [{"val.loss": 1.0}],
    }
    path = tmp_path / ckpt.CHECKPOINT_FILE
    info = ckpt.save_checkpoint(path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.CHECKPOINT_INFO_FILE, ckpt.CHECKPOINT_FILE]
    # The description beside it names the bytes the agent uploads.
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert info["size_bytes"] == path.stat().st_size and info["epoch"] == 2
    assert json.loads((tmp_path / ckpt.CHECKPOINT_INFO_FILE).read_text()) == info
    loaded = ckpt.load_checkpoint(path, job_id="j", architecture="resnet18", classes=["a", "b"])
    assert loaded is not None and loaded["epoch"] == 2
    assert torch.equal(loaded["model"]["weight"], model.weight)
    assert ckpt.load_checkpoint(path, job_id="other", architecture="resnet18", classes=["a", "b"]) is None
    assert (
        ckpt.load_checkpoint(tmp_path / "missing.pt", job_id="j", architecture="resnet18", classes=[]) is None
    )


def test_events_are_json_lines(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path / "events.jsonl")
    writer.metric("val.top1", 0.5, epoch=1, step=10)
    writer.progress(epoch=1, epochs=2, step=10, total_steps=20)
    with pytest.raises(ValueError):
        writer.metric("val.unknown", 1.0, epoch=1, step=10)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert lines[0]["name"] == "val.top1" and lines[0]["rank"] == 0 and lines[1]["type"] == "progress"


def test_single_class_folder_with_sub_folders_is_not_unwrapped(tmp_path: Path) -> None:
    _png(tmp_path / "cat" / "2019" / "a.png")
    assert [Path(p).name for p, _ in image_directory_samples(tmp_path, ["cat"])] == ["a.png"]
