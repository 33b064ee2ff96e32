"""The agent's registry of job kinds (worker/agent/kinds/__init__.py): one run per ``JobKind``,
chosen by the claimed placement's ``type``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.worker.kinds.conftest import evaluate_placement, script_placement, train_placement
from torchyard.contract.jobspec import JobKind
from worker.agent.kinds import RUNS, run_for
from worker.agent.kinds.evaluate import EvaluateRun
from worker.agent.kinds.script import ScriptRun
from worker.agent.kinds.train import TrainRun


def test_every_job_kind_has_one_run_that_answers_to_it() -> None:
    assert sorted(RUNS) == sorted(JobKind)
    for kind, run in RUNS.items():
        assert run.kind is kind


@pytest.mark.parametrize(
    ("placement", "cls"),
    [(train_placement, TrainRun), (script_placement, ScriptRun), (evaluate_placement, EvaluateRun)],
)
def test_a_placement_is_run_by_its_kinds_run(make_host: Any, placement: Any, cls: type) -> None:
    host = make_host(placement())
    run = run_for(host)
    assert type(run) is cls
    assert run.host is host


def test_only_the_trainers_kinds_are_handed_back_when_claimed_while_draining() -> None:
    assert {k for k, run in RUNS.items() if run.hands_back_when_draining} == {JobKind.TRAIN, JobKind.EVALUATE}


def test_a_kind_this_agent_does_not_know_is_a_runtime_error() -> None:
    """A newer API's kind reaches an older agent: the placement fails, naming the type."""
    host = SimpleNamespace(work=SimpleNamespace(type="notebook"))
    with pytest.raises(RuntimeError) as err:
        run_for(host)
    assert str(err.value) == "this agent cannot run jobs of type 'notebook'"
