"""Metrics CSV files become metrics: Lightning's ``CSVLogger`` (``metrics.csv``, written by a
real Lightning run) and timm's ``summary.csv`` (written here line by line as timm does), read
as they grow, by the tailer that reads TensorBoard files."""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

import pytest

from worker.agent.csv_metrics import METRICS_FILE_NAME, column_metric_name
from worker.agent.tensorboard_scalars import ScalarTailer


def _points(metrics: Path) -> list[tuple[str, float, int, int, int]]:
    """(name, value, epoch, step, rank) of each line written."""
    path = metrics / METRICS_FILE_NAME
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(p["name"], p["value"], p["epoch"], p["step"], p["rank"]) for p in lines]


def _tailer(tmp_path: Path) -> tuple[ScalarTailer, Path, Path, Path, logging.Logger]:
    work, outputs = tmp_path / "run" / "work" / "rank-1", tmp_path / "run" / "outputs"
    metrics = tmp_path / "agent" / "metrics"
    work.mkdir(parents=True)
    outputs.mkdir()
    job_log = logging.getLogger(f"test.csv.{tmp_path.name}")
    tailer = ScalarTailer([(work, 1, False), (outputs, 0, True)], metrics, job_log)
    return tailer, work, outputs, metrics, job_log


def _warnings(caplog: pytest.LogCaptureFixture, job_log: logging.Logger) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == job_log.name and r.levelno >= logging.WARNING]


def test_a_lightning_csv_logger_run_is_read_as_metrics(tmp_path: Path) -> None:
    """A real Lightning fit (2 epochs of 3 batches, CPU) with its ``CSVLogger`` in the working
    copy, read at every step as it is written (and rewritten with a wider header when the
    validation loss first appears): every value of its sparse ``metrics.csv`` is a point,
    once, with the file's step and epoch."""
    pytest.importorskip("lightning")
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: list[torch.Tensor], _index: int) -> None:
            self.log("val loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Poll(L.Callback):
        def on_train_batch_end(self, *_args: object) -> None:
            read.append(tailer.poll())

    read: list[int] = []
    tailer, work, _outputs, metrics, _ = _tailer(tmp_path)
    torch.manual_seed(0)
    x = torch.randn(12, 2)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        log_every_n_steps=1,
        logger=CSVLogger(str(work), flush_logs_every_n_steps=1),
        callbacks=[Poll()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(), data, data)
    path = work / "lightning_logs" / "version_0" / "metrics.csv"
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    expected = sorted(
        (column_metric_name(column), float(value), int(row["epoch"]), int(row["step"]), 1)
        for row in rows
        for column, value in row.items()
        if column not in ("epoch", "step") and value != ""
    )
    read.append(tailer.poll())
    assert tailer.poll() == 0  # nothing twice
    assert sum(read) == len(expected) and max(read) < len(expected), read  # read as it grew
    points = sorted(_points(metrics))
    assert points == expected
    assert sorted((e, s) for name, _, e, s, _ in points if name == "val_loss") == [(0, 2), (1, 5)]
    assert sorted((e, s) for name, _, e, s, _ in points if name == "train_loss") == [
        (0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (1, 5)
    ]  # fmt: skip


def test_a_timm_summary_is_read_as_it_grows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """timm appends a row to ``summary.csv`` each epoch (its header with the first): only
    complete lines are read, the epoch is the step, a file in the outputs carries the node's
    first rank; a file rewritten with a wider header (as Lightning's is) is read again from
    its start without its rows counted twice."""
    tailer, _work, outputs, metrics, job_log = _tailer(tmp_path)
    caplog.set_level(logging.INFO)
    folder = outputs / "train" / "20240101-resnet18"
    folder.mkdir(parents=True)
    summary = folder / "summary.csv"
    summary.write_bytes(b"epoch,train_loss,eval_loss,eval_top1,lr\r\n0,2.5,2.25,41.5,0.1\r\n1,2.0,")
    assert tailer.poll() == 4
    with open(summary, "ab") as fh:
        fh.write(b"2.0,55.0,0.05")
    assert tailer.poll() == 0  # the row is not whole yet
    with open(summary, "ab") as fh:
        fh.write(b"\r\n2,1.5,nan,,0.025\r\n")
    assert tailer.poll() == 6
    assert _points(metrics) == [
        ("train_loss", 2.5, 0, 0, 0),
        ("eval_loss", 2.25, 0, 0, 0),
        ("eval_top1", 41.5, 0, 0, 0),
        ("lr", 0.1, 0, 0, 0),
        ("train_loss", 2.0, 1, 1, 0),
        ("eval_loss", 2.0, 1, 1, 0),
        ("eval_top1", 55.0, 1, 1, 0),
        ("lr", 0.05, 1, 1, 0),
        ("train_loss", 1.5, 2, 2, 0),
        ("lr", 0.025, 2, 2, 0),
    ]
    # Rewritten in place with a new column (the same rows first), then a row more.
    text = summary.read_bytes().decode().splitlines()
    rows = [text[0] + ",eval top5"] + [line + "," for line in text[1:]] + ["3,1.25,1.5,70.0,0.0125,90.5"]
    with open(summary, "r+b") as fh:
        fh.truncate(0)
        fh.write(("\r\n".join(rows) + "\r\n").encode())
    assert tailer.poll() == 5
    assert _points(metrics)[-5:] == [
        ("train_loss", 1.25, 3, 3, 0),
        ("eval_loss", 1.5, 3, 3, 0),
        ("eval_top1", 70.0, 3, 3, 0),
        ("lr", 0.0125, 3, 3, 0),
        ("eval_top5", 90.5, 3, 3, 0),
    ]
    assert tailer.poll() == 0
    assert _warnings(caplog, job_log) == []


def test_csv_files_are_read_on_the_agents_terms(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A link or a FIFO named metrics.csv is not opened, a line over the bound ends the
    reading of its file, each said once; a file without epoch or step counts its rows."""
    from worker.agent import csv_metrics

    tailer, work, _outputs, metrics, job_log = _tailer(tmp_path)
    caplog.set_level(logging.INFO)
    secret = tmp_path / "secret.csv"
    secret.write_text("step,token\n0,42\n")
    (work / "a").mkdir()
    (work / "a" / "metrics.csv").symlink_to(secret)
    (work / "b").mkdir()
    os.mkfifo(work / "b" / "metrics.csv")
    (work / "c").mkdir()
    (work / "c" / "metrics.csv").write_text("loss\n0.5\n" + "1" * (csv_metrics.MAX_LINE_BYTES + 1) + "\n")
    (work / "d").mkdir()
    (work / "d" / "summary.csv").write_text("acc\n0.25\n0.5\n")
    for _ in range(2):
        tailer.poll()
    tailer.stop()
    assert sorted(_points(metrics)) == [("acc", 0.25, 0, 0, 1), ("acc", 0.5, 0, 1, 1), ("loss", 0.5, 0, 0, 1)]
    said = _warnings(caplog, job_log)
    assert len(said) == 3, said
    assert any("rank-1/a/metrics.csv is not read: it is not a regular file" in m for m in said)
    assert any("rank-1/b/metrics.csv is not read: it is not a regular file" in m for m in said)
    assert any("rank-1/c/metrics.csv is not read past byte 9" in m for m in said)


def test_column_names_become_metric_names() -> None:
    assert column_metric_name("val loss") == "val_loss"
    assert column_metric_name("top-1 (%)") == "top-1____"
    assert column_metric_name("-x") == "_-x"
    assert column_metric_name(" ") is None
    assert column_metric_name("a" * 80) == "a" * 64
