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


def test_the_schedule_writes_the_first_epoch_end_then_waits_for_the_set_interval(tmp_path: Path) -> None:
    writer = ckpt.CheckpointWriter(tmp_path / ckpt.CHECKPOINT_FILE)
    schedule = ckpt.CheckpointSchedule(writer, 30.0)
    assert schedule.due(now=5.0)  # the attempt's first epoch end, however soon
    schedule.handed_over(now=5.0)
    assert schedule.interval() == 30.0
    assert not schedule.due(now=34.9)
    assert schedule.due(now=35.0)
    every_epoch = ckpt.CheckpointSchedule(writer, 0.0)
    every_epoch.handed_over(now=1.0)
    assert every_epoch.due(now=1.0)
    # Rank 0 without a writer (a benchmark's baseline) never writes one.
    assert not ckpt.CheckpointSchedule(None, 0.0).due(now=1.0)


def test_the_automatic_interval_is_a_multiple_of_the_last_write(tmp_path: Path) -> None:
    writer = ckpt.CheckpointWriter(tmp_path / ckpt.CHECKPOINT_FILE)
    schedule = ckpt.CheckpointSchedule(writer, None)
    assert schedule.due(now=0.0)
    writer.submit(_state(torch.zeros(1000), torch.zeros(1000), 1), label="epoch 1")
    schedule.handed_over(now=0.0)
    writer.wait()
    took = writer.written[-1]["write_seconds"]
    assert took > 0 and schedule.interval() == ckpt.AUTO_INTERVAL_FACTOR * took
    assert not schedule.due(now=0.99 * schedule.interval())
    assert schedule.due(now=schedule.interval())


def test_the_automatic_schedule_skips_an_epoch_end_while_the_last_write_runs(tmp_path: Path) -> None:
    writer = ckpt.CheckpointWriter(tmp_path / ckpt.CHECKPOINT_FILE)
    schedule = ckpt.CheckpointSchedule(writer, None)
    release = threading.Event()
    writer.submit(
        _state(torch.zeros(10), torch.zeros(10), 1), label="epoch 1", before_replace=lambda: release.wait(30)
    )
    schedule.handed_over(now=0.0)
    try:
        assert writer.busy and not schedule.due(now=1e9)
        # A fixed interval does not look at the writer: the next submit waits for it.
        assert ckpt.CheckpointSchedule(writer, 0.0).due(now=1e9) is True
    finally:
        release.set()
        writer.wait()


def test_the_interval_setting_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ckpt.INTERVAL_VAR, raising=False)
    assert ckpt.checkpoint_interval() is None
    monkeypatch.setenv(ckpt.INTERVAL_VAR, " ")
    assert ckpt.checkpoint_interval() is None
    monkeypatch.setenv(ckpt.INTERVAL_VAR, "0")
    assert ckpt.checkpoint_interval() == 0.0
    monkeypatch.setenv(ckpt.INTERVAL_VAR, "90.5")
    assert ckpt.checkpoint_interval() == 90.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(ckpt.INTERVAL_VAR, bad)
        with pytest.raises(ValueError, match=ckpt.INTERVAL_VAR):
            ckpt.checkpoint_interval()
