"""The TensorBoard tailer reads what a script writes without letting it cost the agent
memory, block it, or lead it out of the run's folder: records framed by hand (TFRecord:
length, masked CRC of the length, data, masked CRC of the data) stand for what a script
could write instead of a real event file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from worker.agent import tensorboard_scalars
from worker.agent.tensorboard_scalars import METRICS_FILE_NAME, ScalarTailer

EVENTS = "events.out.tfevents.1700000000.node.1.0"


def _header(length: int) -> bytes:
    size = struct.pack("<Q", length)
    return size + struct.pack("<I", masked_crc32c(size))


def _record(data: bytes) -> bytes:
    return _header(len(data)) + data + struct.pack("<I", masked_crc32c(data))


def _scalar(tag: str, value: float, step: int) -> bytes:
    event = event_pb2.Event(wall_time=1700000000.0, step=step)
    event.summary.value.append(summary_pb2.Summary.Value(tag=tag, simple_value=value))
    return _record(event.SerializeToString())


def _version() -> bytes:
    return _record(event_pb2.Event(wall_time=1700000000.0, file_version="brain.Event:2").SerializeToString())


def _points(metrics: Path) -> list[tuple[str, float, int, int]]:
    path = metrics / METRICS_FILE_NAME
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(p["name"], p["value"], p["step"], p["rank"]) for p in lines]


def _tailer(tmp_path: Path, make_metrics: bool = True) -> tuple[ScalarTailer, Path, Path, logging.Logger]:
    work, metrics = tmp_path / "run" / "work" / "rank-0", tmp_path / "agent" / "metrics"
    (work / "runs").mkdir(parents=True)
    if make_metrics:
        metrics.mkdir(parents=True)
    job_log = logging.getLogger(f"test.tensorboard.{tmp_path.name}")
    return ScalarTailer([(work, 0, False)], metrics, job_log), work / "runs", metrics, job_log


def _warnings(caplog: pytest.LogCaptureFixture, job_log: logging.Logger) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == job_log.name and r.levelno >= logging.WARNING]


def _promptly(call: Callable[[], object], seconds: float = 10.0) -> None:
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(seconds), f"{call} did not return within {seconds} s"


def test_a_record_length_no_file_could_hold_is_never_allocated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 4 KiB sparse file claiming a 768 MiB record in 512 MiB: nothing near that size is
    read into memory, the scalars before it are kept, and it is said once."""
    tailer, runs, metrics, job_log = _tailer(tmp_path)
    path = runs / EVENTS
    path.write_bytes(_version() + _scalar("loss", 0.5, 1) + _header(768 << 20) + b"\0" * 4000)
    os.truncate(path, 512 << 20)
    caplog.set_level(logging.INFO)
    tracemalloc.start()
    try:
        for _ in range(3):
            _promptly(tailer.poll)
        _size, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated while reading a 4 KiB file"
    assert _points(metrics) == [("loss", 0.5, 1, 0)]
    said = [m for m in _warnings(caplog, job_log) if EVENTS in m]
    assert len(said) == 1 and "MiB" in said[0], said


def test_an_incomplete_record_waits_for_the_rest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tailer, runs, metrics, job_log = _tailer(tmp_path)
    record = _scalar("loss", 0.25, 2)
    path = runs / EVENTS
    caplog.set_level(logging.INFO)
    path.write_bytes(_version() + record[:5])  # not even a whole length yet
    assert tailer.poll() == 0
    with open(path, "ab") as fh:
        fh.write(record[5:20])  # the length, not the data
    assert tailer.poll() == 0
    with open(path, "ab") as fh:
        fh.write(record[20:])
    assert tailer.poll() == 1
    assert _points(metrics) == [("loss", 0.25, 2, 0)]
    assert _warnings(caplog, job_log) == []


def test_a_corrupt_length_stops_that_file_and_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tailer, runs, metrics, job_log = _tailer(tmp_path)
    bad = bytearray(_scalar("loss", 2.0, 3))
    bad[8] ^= 0xFF  # the length's CRC
    caplog.set_level(logging.INFO)
    (runs / EVENTS).write_bytes(_version() + _scalar("loss", 1.0, 1) + bytes(bad) + _scalar("loss", 3.0, 4))
    (runs / "events.out.tfevents.other").write_bytes(_scalar("acc", 0.5, 1))
    assert tailer.poll() == 2
    assert tailer.poll() == 0
    assert sorted(_points(metrics)) == [("acc", 0.5, 1, 0), ("loss", 1.0, 1, 0)]
    said = _warnings(caplog, job_log)
    assert len(said) == 1 and EVENTS in said[0] and "corrupt" in said[0], said


def test_a_record_over_the_cap_is_skipped_unread_and_the_file_read_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image or a graph bigger than the cap is never read; the scalars after it are."""
    monkeypatch.setattr(tensorboard_scalars, "MAX_RECORD_BYTES", 1024)
    tailer, runs, metrics, job_log = _tailer(tmp_path)
    caplog.set_level(logging.INFO)
    image = event_pb2.Event(step=1)
    image.summary.value.append(summary_pb2.Summary.Value(tag="img", image=summary_pb2.Summary.Image(
        encoded_image_string=b"\x89PNG" * 1000)))  # fmt: skip
    data = _version() + _scalar("loss", 1.0, 1) + _record(image.SerializeToString()) + _scalar("loss", 0.5, 2)
    (runs / EVENTS).write_bytes(data)
    assert tailer.poll() == 2
    assert _points(metrics) == [("loss", 1.0, 1, 0), ("loss", 0.5, 2, 0)]
    said = _warnings(caplog, job_log)
    assert len(said) == 1 and EVENTS in said[0], said


def test_each_poll_reads_a_bounded_amount_of_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = [_scalar("loss", 1.0, step) for step in range(1, 26)]  # each of one size
    monkeypatch.setattr(tensorboard_scalars, "MAX_BYTES_PER_POLL", 10 * len(records[0]))
    tailer, runs, metrics, _ = _tailer(tmp_path)
    (runs / EVENTS).write_bytes(b"".join(records))
    assert [tailer.poll() for _ in range(4)] == [10, 10, 5, 0]
    assert [p[2] for p in _points(metrics)] == list(range(1, 26))


def test_fifos_and_links_named_tfevents_are_skipped_without_blocking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO would block an open for reading until a writer comes; a link could point the
    agent at any file. Neither is opened; each is said once; ``stop()`` returns."""
    tailer, runs, metrics, _ = _tailer(tmp_path)
    outside = tmp_path / "elsewhere" / EVENTS
    outside.parent.mkdir()
    outside.write_bytes(_scalar("secret", 42.0, 1))
    fifo = runs / "events.out.tfevents.fifo"
    os.mkfifo(fifo)
    (runs / "events.out.tfevents.link").symlink_to(outside)
    (runs / "linked").symlink_to(outside.parent, target_is_directory=True)
    (runs / EVENTS).write_bytes(_scalar("loss", 1.0, 1))
    caplog.set_level(logging.INFO)
    try:
        _promptly(tailer.poll)
        _promptly(tailer.poll)
        tailer.start()
        _promptly(tailer.stop)
    finally:
        # A reader stuck opening the FIFO is released by a writer.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert _points(metrics) == [("loss", 1.0, 1, 0)]
    said = [m for m in caplog.messages if "fifo" in m or ".link" in m]
    assert len(said) == 2, said
    assert any("events.out.tfevents.fifo" in m for m in said)
    assert any("events.out.tfevents.link" in m for m in said)


def test_summary_writer_files_are_read_and_the_metrics_folder_is_made(tmp_path: Path) -> None:
    import numpy
    from torch.utils.tensorboard import SummaryWriter

    tailer, runs, metrics, _ = _tailer(tmp_path, make_metrics=False)
    writer = SummaryWriter(log_dir=str(runs / "exp"))
    for step in range(3):
        writer.add_scalar("train/loss", 1.0 / 2**step, step)
    writer.add_histogram("weights", numpy.array([0.1, 0.2, 0.3]), 0)
    writer.close()
    assert tailer.poll() == 3
    assert _points(metrics) == [
        ("train/loss", 1.0, 0, 0),
        ("train/loss", 0.5, 1, 0),
        ("train/loss", 0.25, 2, 0),
    ]
    assert tailer.poll() == 0  # nothing appended: nothing read twice


def test_add_scalars_series_are_named_as_tensorboard_shows_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``add_scalars`` writes each key's series to a folder ``<tag>_<key>`` of its own, all
    with the one tag: named by the tag alone, the second series would be dropped as repeated
    points of the first (the PyTorch tutorial's validation loss)."""
    from torch.utils.tensorboard import SummaryWriter

    tailer, runs, metrics, job_log = _tailer(tmp_path)
    writer = SummaryWriter(log_dir=str(runs / "exp"))
    for epoch in range(1, 3):
        writer.add_scalars(
            "Training vs. Validation Loss", {"Training": 1.0 / epoch, "Validation": 2.0 / epoch}, epoch
        )
        writer.add_scalars("acc/top", {"1": 0.5, "5": 0.75}, epoch)
    writer.add_scalar("lr", 0.125, 1)
    writer.close()
    caplog.set_level(logging.INFO)
    assert tailer.poll() == 9
    assert sorted(_points(metrics)) == [
        ("Training_vs._Validation_Loss/Training", 0.5, 2, 0),
        ("Training_vs._Validation_Loss/Training", 1.0, 1, 0),
        ("Training_vs._Validation_Loss/Validation", 1.0, 2, 0),
        ("Training_vs._Validation_Loss/Validation", 2.0, 1, 0),
        ("acc/top/1", 0.5, 1, 0),
        ("acc/top/1", 0.5, 2, 0),
        ("acc/top/5", 0.75, 1, 0),
        ("acc/top/5", 0.75, 2, 0),
        ("lr", 0.125, 1, 0),
    ]
    assert _warnings(caplog, job_log) == []


def test_one_tag_of_two_writers_is_two_metrics_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two SummaryWriters (``runs/train``, ``runs/val``) both logging ``loss``: the folder
    found later names its series (``val/loss``), said once; another rank's ``loss`` is its
    own, and two series that would both be ``val/loss`` are told apart by the parent folder."""
    from torch.utils.tensorboard import SummaryWriter

    tailer, runs, metrics, job_log = _tailer(tmp_path)
    other = tmp_path / "run" / "work" / "rank-1"
    tailer.roots.append((other, 1, False))
    caplog.set_level(logging.INFO)
    train, val = SummaryWriter(log_dir=str(runs / "train")), SummaryWriter(log_dir=str(runs / "val"))
    for step in range(2):
        train.add_scalar("loss", 1.0 + step, step)
        val.add_scalar("loss", 10.0 + step, step)
    train.flush()
    val.flush()
    assert tailer.poll() == 4
    train.add_scalar("loss", 3.0, 2)
    val.add_scalar("loss", 12.0, 2)
    train.close()
    val.close()
    for folder in (other / "runs" / "val", runs / "again" / "val"):
        writer = SummaryWriter(log_dir=str(folder))
        writer.add_scalar("loss", 7.0, 0)
        writer.close()
    assert tailer.poll() == 4
    assert sorted(_points(metrics)) == [
        ("again/val/loss", 7.0, 0, 0),
        ("loss", 1.0, 0, 0),
        ("loss", 2.0, 1, 0),
        ("loss", 3.0, 2, 0),
        ("loss", 7.0, 0, 1),
        ("val/loss", 10.0, 0, 0),
        ("val/loss", 11.0, 1, 0),
        ("val/loss", 12.0, 2, 0),
    ]
    said = _warnings(caplog, job_log)
    assert said == [
        "TensorBoard scalar 'loss' of rank-0/runs/val is the metric val/loss: rank 0's loss comes from "
        "rank-0/runs/train",
        "TensorBoard scalar 'loss' of rank-0/runs/again/val is the metric again/val/loss: rank 0's "
        "loss comes from rank-0/runs/train",
    ], said


def test_event_files_copied_to_the_mlflow_artifacts_are_not_read_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``mlflow.log_artifacts(<log dir>)`` copies event files into the MLflow endpoint's
    artifact folder in the outputs: they are no series being written (MLflow's own example
    logs ``train_loss`` to MLflow and to a temporary log dir it then keeps as artifacts).
    Another copy of a file already read (the same name, the writer's own) is not read either."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    from worker.agent.script_launch import ScriptLaunch
    from worker.agent.script_run import ScriptGroup

    launch = ScriptLaunch(
        run_dir=tmp_path / "runs" / "r1",
        node_name="n1",
        node_rank=0,
        node_count=1,
        nproc=1,
        master_addr="127.0.0.1",
        master_port=29400,
        cpus=1,
        command=("python", "train.py"),
    )
    job_log = logging.getLogger(f"test.tensorboard.{tmp_path.name}")
    group = ScriptGroup(launch, job_log=job_log)
    caplog.set_level(logging.INFO)
    try:
        work = group.processes[0].cwd
        work.mkdir(parents=True)
        elsewhere = tmp_path / "tmp" / "tb"
        writer = SummaryWriter(log_dir=str(elsewhere))
        for step in range(10):
            writer.add_scalar("train_loss", 1.0 / (step + 1), step)
        writer.close()
        shutil.copytree(elsewhere, launch.outputs_dir / "mlflow" / "0123abcd" / "artifacts" / "events")
        shutil.copytree(elsewhere, launch.outputs_dir / "tb")
        assert group.scalars.poll() == 10
        shutil.copytree(elsewhere, work / "tb-copy")
        assert group.scalars.poll() == 0
    finally:
        group.close_tracking()
    points = _points(launch.agent_metrics_dir)
    assert [(p[0], p[2]) for p in points] == [("train_loss", step) for step in range(10)]
    said = _warnings(caplog, job_log)
    assert (
        len(said) == 1
        and "rank-0/tb-copy/events.out.tfevents" in said[0]
        and "is a copy of outputs/tb/" in said[0]
    )
