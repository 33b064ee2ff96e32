"""``torchyard sweep``: the spec a sweep file and ``--set`` make, and the tables it prints
(the commands against a live API are in tests/e2e/test_sweeps.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchyard.apiclient.sweeps import Sweep
from torchyard.commands.sweeps import build_sweep_spec, sweep_text, trials_table

SWEEP_YAML = """
name: digits-lr
job:
  model: {architecture: resnet18}
  train_dataset: digits-train
  validation_dataset: digits-val
  parameters: {epochs: 3}
search_space:
  parameters.learning_rate: {type: float, low: 0.001, high: 0.5, log: true}
algorithm: tpe
max_trials: 8
"""


def test_set_reaches_the_job_the_sweep_and_a_search_space_key_with_dots(tmp_path: Path) -> None:
    spec_file = tmp_path / "sweep.yaml"
    spec_file.write_text(SWEEP_YAML)
    args = argparse.Namespace(
        spec=str(spec_file),
        name="renamed",
        set=[
            "job.parameters.epochs=5",
            "max_trials=12",
            "search_space.parameters.learning_rate.high=0.1",
            "search_space.parameters.batch_size.type=categorical",
            "search_space.parameters.batch_size.choices=[16, 32]",
        ],
    )
    spec = build_sweep_spec(args)
    assert spec["name"] == "renamed" and spec["max_trials"] == 12
    assert spec["job"]["parameters"]["epochs"] == 5
    assert spec["search_space"]["parameters.learning_rate"]["high"] == 0.1
    assert spec["search_space"]["parameters.learning_rate"]["log"] is True
    assert spec["search_space"]["parameters.batch_size"] == {"type": "categorical", "choices": [16, 32]}


def test_show_and_trials_name_the_best_trial_and_each_trials_state() -> None:
    trial = {
        "number": 1,
        "job_id": "b" * 32,
        "params": {"parameters.learning_rate": 0.0123456},
        "state": "pruned",
        "value": 0.41,
        "epochs": 3,
        "reason": "pruned by ASHA at epoch 3: val.top1 0.41 below the rung's top third",
    }
    best = {**trial, "number": 0, "job_id": "a" * 32, "state": "completed", "value": 0.9, "reason": None}
    sweep = Sweep.model_validate(
        {
            "id": "s" * 32,
            "name": "digits-lr",
            "status": "succeeded",
            "algorithm": "tpe",
            "objective": {"metric": "val.top1", "goal": "maximize"},
            "early_stopping": {"type": "asha"},
            "search_space": {"parameters.learning_rate": {}},
            "trial_counts": {"completed": 1, "pruned": 1},
            "max_trials": 2,
            "max_concurrent_trials": 1,
            "epochs_run": 8,
            "best_trial": best,
            "trials": [best, trial],
        }
    )
    text = sweep_text(sweep)
    assert "best      trial 0: 0.9 (learning_rate=0.01235), job " + "a" * 32 in text
    assert "1 completed, 1 pruned" in text and "8 epochs run" in text
    table = trials_table(sweep.trials or []).splitlines()
    assert table[0].split()[:5] == ["#", "STATE", "VALUE", "EPOCHS", "PARAMETERS"]
    assert table[2].split()[:4] == ["1", "pruned", "0.41", "3"] and "pruned by ASHA at epoch 3" in table[2]
