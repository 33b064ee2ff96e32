"""Evaluations on the agent (worker/agent/kinds/evaluate.py): the trainer in evaluation mode on
the registered model's directory. It runs as training does (tests/worker/kinds/test_train.py)
except for what differs here: the trainer's task, no hang watchdog, and no model of its own
to upload at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.worker.kinds.conftest import FakeRunInputs, StartedGroup, evaluate_placement
from torchyard.contract.jobfile import TrainerTask
from torchyard.contract.jobspec import JobKind
from worker.agent.kinds.evaluate import EvaluateRun

pytestmark = pytest.mark.usefixtures("no_trainer_processes")


def test_an_evaluation_prepares_the_trainer_in_evaluation_mode(make_host: Any) -> None:
    host = make_host(evaluate_placement())
    run = EvaluateRun(host)
    run.prepare()
    [made] = FakeRunInputs.made
    assert made["task"] is TrainerTask.EVALUATE
    assert made["work"] is host.placement and made["run_dir"] == host.run_dir
    assert run.job is not None and run.job.evaluates
    # The registered model's directory (init_from_job) is among what the ranks read.
    assert run.job.init_from_dir == str(host.ctx.work_dir / "models" / "init")
    assert EvaluateRun.kind is JobKind.EVALUATE
    assert EvaluateRun.hands_back_when_draining


def test_an_evaluation_runs_one_rank_under_torchrun_without_a_hang_watchdog(make_host: Any) -> None:
    host = make_host(evaluate_placement(hang_timeout_s=60))
    run = EvaluateRun(host)
    run.prepare()
    group, _ = run.launch(host.agent_dir / "agent.log")
    assert isinstance(group, StartedGroup)
    assert (group.spec.nproc, group.spec.node_count, group.spec.node_rank) == (1, 1, 0)
    assert group.command[group.command.index("--config") + 1] == str(host.run_dir / "job.json")
    assert host.watchdog is None  # a hang timeout is a training job's


def test_an_evaluations_success_uploads_no_model(make_host: Any) -> None:
    host = make_host(evaluate_placement())
    run = EvaluateRun(host)
    run.prepare()
    run.launch(host.agent_dir / "agent.log")
    assert run.outcome(0, Path(host.agent_dir / "agent.log")) == ("succeeded", None)
    assert host.report.model_uploads == []
