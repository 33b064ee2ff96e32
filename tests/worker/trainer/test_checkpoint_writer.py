"""Rank 0's background checkpoint writer: training hands over a copy of its state and
goes on; the file and its description are published whole, in order, and a failed
write is reported on the training thread."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from worker.trainer import checkpoint as ckpt


def _state(weights: torch.Tensor, momentum: torch.Tensor, epoch: int) -> dict[str, object]:
    optimizer = {"state": {0: {"momentum_buffer": momentum}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    return {
        "job_id": "job",
        "epoch": epoch,
        "step": 10 * epoch,
        "model": {"w": weights.clone()},
        "optimizer": ckpt.detached(optimizer),
        "history": ckpt.detached([{"epoch": epoch, "val.loss": 1.0}]),
    }


def test_training_goes_on_while_the_write_is_held_and_the_copy_is_what_is_written(tmp_path: Path) -> None:
    weights = torch.arange(100_000, dtype=torch.float32)
    momentum = torch.ones(100_000)
    release = threading.Event()
    writer = ckpt.CheckpointWriter(tmp_path / ckpt.CHECKPOINT_FILE)

    started = time.perf_counter()
    waited = writer.submit(
        _state(weights, momentum, 1), label="epoch 1", before_replace=lambda: release.wait(10)
    )
    assert time.perf_counter() - started < 2.0 and waited < 0.5
    # The write is held before its rename: nothing is published yet, the caller is free.
    assert writer.busy and not (tmp_path / ckpt.CHECKPOINT_FILE).exists()
    # Training changes its tensors in place meanwhile (the next optimizer steps).
    weights.add_(5.0)
    momentum.mul_(3.0)
    release.set()
    writer.wait()

    state = torch.load(tmp_path / ckpt.CHECKPOINT_FILE, weights_only=True)
    assert torch.equal(state["model"]["w"], torch.arange(100_000, dtype=torch.float32))
    assert torch.equal(state["optimizer"]["state"][0]["momentum_buffer"], torch.ones(100_000))
    # The description names these very bytes: sha256 computed while writing, inode, size, mtime.
    info = json.loads((tmp_path / ckpt.CHECKPOINT_INFO_FILE).read_text())
    data = (tmp_path / ckpt.CHECKPOINT_FILE).read_bytes()
    stat = os.stat(tmp_path / ckpt.CHECKPOINT_FILE)
    assert info["sha256"] == hashlib.sha256(data).hexdigest() and info["size_bytes"] == len(data)
    assert (info["inode"], info["mtime_ns"]) == (stat.st_ino, stat.st_mtime_ns)
    assert info["epoch"] == 1 and writer.written[-1]["sha256"] == info["sha256"]
    assert not list(tmp_path.glob(".checkpoint.pt.tmp-*"))


def test_a_second_checkpoint_waits_for_the_first_write(tmp_path: Path) -> None:
    release = threading.Event()
    writer = ckpt.CheckpointWriter(tmp_path / ckpt.CHECKPOINT_FILE)
    writer.submit(
        _state(torch.zeros(10), torch.zeros(10), 1), label="epoch 1", before_replace=lambda: release.wait(10)
    )
    second_done = threading.Event()
    waited: list[float] = []

    def submit_second() -> None:
        waited.append(writer.submit(_state(torch.ones(10), torch.ones(10), 2), label="epoch 2"))
        second_done.set()

    thread = threading.Thread(target=submit_second)
    thread.start()
    assert not second_done.wait(0.5)  # held behind the first write
    release.set()
    assert second_done.wait(30)
    thread.join()
    writer.wait()
    assert waited[0] >= 0.4
    assert [w["epoch"] for w in writer.written] == [1, 2]
    state = torch.load(tmp_path / ckpt.CHECKPOINT_FILE, weights_only=True)
    assert state["epoch"] == 2 and torch.equal(state["model"]["w"], torch.ones(10))
    assert json.loads((tmp_path / ckpt.CHECKPOINT_INFO_FILE).read_text())["epoch"] == 2


def test_a_failed_write_is_raised_by_wait_and_logged_by_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer = ckpt.CheckpointWriter(run_dir / ckpt.CHECKPOINT_FILE)
    writer.submit(_state(torch.zeros(10), torch.zeros(10), 1), label="epoch 1")
    writer.wait()
    shutil.rmtree(run_dir)  # the run directory is gone: the next write cannot even start its file
    writer.submit(_state(torch.zeros(10), torch.zeros(10), 2), label="epoch 2")
    with pytest.raises(ckpt.CheckpointWriteError, match="after epoch 2"):
        writer.wait()
    writer.wait()  # reported once

    writer.submit(_state(torch.zeros(10), torch.zeros(10), 3), label="epoch 3")
    with caplog.at_level("ERROR", logger=ckpt.__name__):
        writer.close()
    assert "after epoch 3 failed" in caplog.text


def test_detached_copies_containers_and_tensors() -> None:
    tensor = torch.zeros(3)
    value = {"a": [tensor, (tensor, 1)], "b": "x"}
    copy = ckpt.detached(value)
    tensor.add_(1)
    value["a"].append(2)  # type: ignore[attr-defined]
    assert torch.equal(copy["a"][0], torch.zeros(3)) and torch.equal(copy["a"][1][0], torch.zeros(3))
    assert len(copy["a"]) == 2 and copy["b"] == "x"
