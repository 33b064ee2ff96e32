"""The effective learning rate: one contract function for the trainer, ``torchyard show``
and (mirrored in ``dom.js``) the web UI's job form."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.support import REPO_ROOT
from torchyard.client import Job
from torchyard.commands.job_show import print_job
from torchyard.contract.learning_rate import (
    describe_schedule,
    effective_learning_rate,
    schedule_of,
    world_size_of,
)

CASES = [
    (
        {"learning_rate": 0.02, "warmup_epochs": 1, "epochs": 5},
        {"node_count": 1, "process_count_per_node": 1},
    ),
    (
        {"learning_rate": 0.05, "warmup_epochs": 0, "epochs": 3},
        {"node_count": 2, "process_count_per_node": 1},
    ),
    (
        {"learning_rate": 0.1, "warmup_epochs": 3, "epochs": 10},
        {"node_count": 1, "process_count_per_node": 3},
    ),
]


def test_the_rate_is_scaled_by_the_processes_and_reached_after_the_warm_up() -> None:
    assert effective_learning_rate(0.02, 1) == 0.02
    assert effective_learning_rate(0.05, 4) == pytest.approx(0.2)
    assert world_size_of({"node_count": 2, "process_count_per_node": 4}) == 8
    assert world_size_of(None) == 1
    assert describe_schedule(*CASES[0]) == (
        "0.02 (1 process: effective 0.02); reached after a linear warm-up over the first epoch, "
        "then a linear decay to 0 at the end of epoch 5"
    )
    assert describe_schedule(*CASES[1]).startswith("0.05 × 2 processes = 0.1 effective; from the first step")
    assert "0.1 × 3 processes = 0.3 effective" in describe_schedule(*CASES[2])
    assert "over the first 3 epochs" in describe_schedule(*CASES[2])
    # What a spec leaves out is the service's default (0.001, no warm-up, 5 epochs).
    assert schedule_of({}, {}).effective == 0.001 and schedule_of({}, {}).warmup_epochs == 0


def test_show_prints_the_schedule_of_a_training_job(capsys: pytest.CaptureFixture[str]) -> None:
    params, resources = CASES[1]
    print_job(Job(id="j" * 32, name="lr", status="queued", parameters=params, resources=resources))
    out = capsys.readouterr().out
    assert f"lr schedule: {describe_schedule(params, resources)}\n" in out


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the UI's module")
def test_the_job_form_says_what_the_contract_says() -> None:
    script = (
        "import('./service/ui/static/dom.js').then((m) => console.log(JSON.stringify("
        + json.dumps(CASES)
        + ".map(([p, r]) => `${m.effectiveLrText(p.learning_rate, m.processCount(r))}; "
        "${m.lrScheduleText(String(p.warmup_epochs), String(p.epochs))}`))))"
    )
    done = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == [describe_schedule(p, r) for p, r in CASES]
