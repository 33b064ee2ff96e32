"""What every job kind answers on the agent (worker/agent/kinds/base.py): a kind must say how it
describes, prepares, launches and judges its placement; closing is optional."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.worker.kinds.conftest import FakeHost, script_placement
from torchyard.contract.failures import FailureReport
from torchyard.contract.jobspec import JobKind
from worker.agent.kinds.base import KindRun


class Minimal(KindRun):
    kind: ClassVar[JobKind] = JobKind.SCRIPT

    def describe(self) -> None:
        pass

    def prepare(self) -> None:
        pass

    def launch(self, agent_log: Path) -> Any:
        return None, None

    def outcome(self, exit_code: int | None, agent_log: Path) -> tuple[str, FailureReport | None]:
        return "succeeded", None


def test_a_kind_keeps_its_host_and_by_default_is_not_handed_back_nor_closes_anything(make_host: Any) -> None:
    host: FakeHost = make_host(script_placement())
    run = Minimal(host)
    assert run.host is host
    assert not Minimal.hands_back_when_draining
    run.close()  # the default: nothing to close


@pytest.mark.parametrize("missing", ["describe", "prepare", "launch", "outcome"])
def test_a_kind_must_say_each_step(make_host: Any, missing: str) -> None:
    incomplete = type("Incomplete", (Minimal,), {missing: KindRun.__dict__[missing]})
    with pytest.raises(TypeError, match=missing):
        incomplete(make_host(script_placement()))
