"""Pretrained weights from the service's store (docs/fine-tuning.md): the trainer loads the
node's verified copy, checks that it fits the architecture and trains a new head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision

from tests.support.trainer_helpers import Digits, read_failure, run_torchrun, write_job
from torchyard.contract.errors import InvalidModelDirectoryError
from worker.trainer.config import load_job
from worker.trainer.models import build_model, pretrained_cache_file


def _job_with_weights(tmp_path: Path, digits: Digits, weights_file: Path, architecture: str) -> Path:
    path = write_job(tmp_path / "run", digits, architecture=architecture, pretrained=True)
    job = json.loads(path.read_text(encoding="utf-8"))
    job["model"]["weights_file"] = str(weights_file)
    path.write_text(json.dumps(job), encoding="utf-8")
    return path


def test_stored_weights_are_loaded_and_get_a_new_head(tmp_path: Path, digits: Digits) -> None:
    torch.manual_seed(7)
    imagenet = torchvision.models.squeezenet1_1(num_classes=1000)  # stands in for published weights
    stored = tmp_path / "cache" / "ab12.pth"
    stored.parent.mkdir()
    torch.save(imagenet.state_dict(), stored)
    job = load_job(_job_with_weights(tmp_path, digits, stored, "squeezenet1_1"))

    built = build_model(job)
    assert built.initialized_from == "pretrained:ab12"
    assert built.module.get_submodule("classifier.1").out_channels == 10
    for name in ("features.0", "features.12.expand3x3"):
        assert torch.equal(built.module.get_submodule(name).weight, imagenet.get_submodule(name).weight), name


def test_weights_of_another_architecture_are_refused(tmp_path: Path, digits: Digits) -> None:
    stored = tmp_path / "other.pth"
    torch.save(torchvision.models.squeezenet1_0(num_classes=1000).state_dict(), stored)
    job = load_job(_job_with_weights(tmp_path, digits, stored, "squeezenet1_1"))
    with pytest.raises(InvalidModelDirectoryError, match="do not fit squeezenet1_1"):
        build_model(job)
    stored.write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(InvalidModelDirectoryError, match="cannot read the stored pretrained weights"):
        build_model(job)


def test_unreadable_hub_weights_fail_the_run_with_one_clear_message(tmp_path: Path, digits: Digits) -> None:
    """A node's cached hub file that is damaged fails the run as torchrun runs it, the agent's
    way: the error is printed once in the output (no traceback nor torchrun summary
    repeating it), and it names the two ways to add weights."""
    job = write_job(tmp_path / "run", digits, pretrained=True, epochs=1)
    torch_home = tmp_path / "torch-home"
    damaged = torch_home / "hub" / "checkpoints" / pretrained_cache_file("resnet18").name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"PK\x03\x04 cut short")
    result = run_torchrun(
        job,
        nproc=1,
        env={"TORCH_HOME": str(torch_home), "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")},
    )
    assert result.returncode != 0
    failure = read_failure(tmp_path / "run", 0)
    assert failure["code"] == InvalidModelDirectoryError.code
    message = failure["message"]
    assert message.startswith("cannot load the cached pretrained weights of resnet18")
    assert "'torchyard weights upload resnet18 FILE'" in message
    assert "TORCHYARD_WORKER_PRETRAINED_FROM_HUB=1" in message
    assert result.output.count("cannot load the cached pretrained weights") == 1, result.output
    assert result.output.count(message) == 1, result.output
