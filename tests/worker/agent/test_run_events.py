"""``events.jsonl`` between the trainer and the agent: what the trainer writes is what the
agent reads into a report batch, and lines that are not events are skipped as they were."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from torchyard.contract.reports import ReportBatch
from worker.agent.run_files import RunFileReader
from worker.trainer.events import EventWriter


def _reader(run: Path) -> RunFileReader:
    agent_log = run / "agent.log"
    agent_log.write_text("")
    return RunFileReader("job", run, list, agent_log, "n1")


def test_what_the_trainer_writes_is_a_valid_report_batch(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path / "events.jsonl")
    writer.metric("train.loss", 0.5, epoch=1, step=3)
    writer.progress(epoch=1, epochs=2, step=3, total_steps=6)
    writer.result(
        best_epoch=1,
        best={"val.loss": 0.4, "val.top1": 0.9},
        final={"val.loss": 0.4, "train.loss": 0.5},
        stopped_early=False,
        epochs_run=1,
    )
    writer.close()
    batch = _reader(tmp_path).collect(final=True)
    ReportBatch.model_validate_json(json.dumps(batch.payload()))  # the API's own check
    [point] = batch.metrics
    assert (point["name"], point["value"], point["epoch"], point["step"], point["rank"]) == (
        "train.loss",
        0.5,
        1,
        3,
        0,
    )
    assert batch.progress is not None and (batch.progress["step"], batch.progress["total_steps"]) == (3, 6)
    assert batch.result == {
        "best_epoch": 1,
        "best": {"val.loss": 0.4, "val.top1": 0.9},
        "final": {"val.loss": 0.4, "train.loss": 0.5},
        "stopped_early": False,
        "epochs_run": 1,
        "evaluation": None,
    }


def test_lines_that_are_not_events_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = [
        "not json",
        "[1, 2]",  # JSON, not an object: skipped silently
        '{"type": "checkpoint", "epoch": 1}',  # another type: skipped silently
        '{"type": "metric", "name": "bogus", "value": 1, "epoch": 1, "step": 1}',
        '{"type": "metric", "name": "train.loss", "value": true, "epoch": 1, "step": 1}',
        '{"type": "metric", "name": "train.loss", "value": 1.0, "epoch": 1.0, "step": 1}',
        '{"type": "progress", "epoch": 1, "epochs": 0, "step": 1, "total_steps": 2}',
        '{"type": "result", "best": {}}',
        # Valid, without a time (stamped when read), with an unknown field (ignored).
        '{"type": "metric", "name": "val.loss", "value": 2, "epoch": 1, "step": 4, "extra": 1}',
        # A result's unknown metrics and values that are not finite numbers are left out.
        '{"type": "result", "best_epoch": 2, "epochs_run": 3, "best": {"val.loss": 0.1, "x.y": 1,'
        ' "val.top1": "0.9"}, "final": 7, "stopped_early": 1}',
    ]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="worker.agent.reporting"):
        batch = _reader(tmp_path).collect(final=True)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "job job: ignoring a malformed line in events.jsonl",
        "job job: ignoring an invalid metric event",
        "job job: ignoring an invalid metric event",
        "job job: ignoring an invalid metric event",
        "job job: ignoring an invalid progress event",
        "job job: ignoring an invalid result event",
    ]
    assert [(p["name"], p["value"], p["step"]) for p in batch.metrics] == [("val.loss", 2.0, 4)]
    assert batch.progress is None
    assert batch.result == {
        "best_epoch": 2,
        "best": {"val.loss": 0.1},
        "final": {},
        "stopped_early": True,
        "epochs_run": 3,
        "evaluation": None,
    }
