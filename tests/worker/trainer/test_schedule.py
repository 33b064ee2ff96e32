"""Learning-rate schedule and the optimizer/scheduler stepping of the training loop."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from worker.trainer import distributed
from worker.trainer.distributed import read_env
from worker.trainer.events import NullEventWriter
from worker.trainer.hooks import Hooks
from worker.trainer.loop import BatchPreparer, LossMeter, TrainLoop, autocast_factory
from worker.trainer.schedule import build_scheduler, lr_at


def test_warmup_is_a_linear_ramp_to_the_base_rate() -> None:
    values = [lr_at(step, total_steps=100, warmup_steps=10, base_lr=0.1) for step in range(10)]
    assert values[0] == pytest.approx(0.01)
    assert values[-1] == pytest.approx(0.1)
    steps = [b - a for a, b in itertools.pairwise(values)]
    assert all(s == pytest.approx(0.01) for s in steps)
    assert lr_at(10, 100, 10, 0.1) == pytest.approx(0.1)  # decay starts from the peak


def test_decay_reaches_zero_at_the_last_step() -> None:
    total = 50
    values = [lr_at(step, total, 0, 0.2) for step in range(total + 1)]
    assert values[0] == pytest.approx(0.2)
    assert all(a > b for a, b in itertools.pairwise(values))
    assert 0 < values[total - 1] <= 0.2 / total + 1e-12  # the last iteration still learns a little
    assert values[total] == 0.0
    assert lr_at(total + 5, total, 0, 0.2) == 0.0


def test_warmup_of_every_step_never_decays() -> None:
    assert [lr_at(s, 4, 4, 1.0) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_at(4, 4, 4, 1.0) == 0.0


def test_invalid_schedule_arguments() -> None:
    with pytest.raises(ValueError):
        lr_at(0, 0, 0, 0.1)
    with pytest.raises(ValueError):
        lr_at(0, 10, 11, 0.1)


def test_scheduler_follows_lr_at_with_the_world_size_scaled_rate() -> None:
    learning_rate, world_size, total, warmup = 0.01, 4, 30, 6
    base = learning_rate * world_size
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base, momentum=0.9)
    scheduler = build_scheduler(optimizer, base_lr=base, total_steps=total, warmup_steps=warmup)
    seen = []
    for _ in range(total):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr_at(s, total, warmup, base) for s in range(total)])
    assert max(seen) == pytest.approx(0.04)
    assert optimizer.param_groups[0]["lr"] == 0.0


def test_scheduler_can_start_mid_run() -> None:
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scheduler = build_scheduler(optimizer, base_lr=0.1, total_steps=20, warmup_steps=5, start_step=12)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(12, 20, 5, 0.1))
    assert scheduler.last_epoch == 12


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.fixture
def process_group(single_process: None) -> Iterator[torch.device]:
    device = torch.device("cpu")
    distributed.setup(read_env(), device)
    yield device
    distributed.teardown()


def test_optimizer_and_scheduler_step_exactly_once_per_iteration(process_group: torch.device) -> None:
    torch.manual_seed(0)
    model = _Counting()
    iterations, epochs = 7, 2
    batches = [
        (torch.randint(0, 256, (4, 3, 4, 4), dtype=torch.uint8), torch.randint(0, 3, (4,)))
        for _ in range(iterations)
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    total = iterations * epochs
    scheduler = build_scheduler(optimizer, base_lr=0.1, total_steps=total, warmup_steps=iterations)
    steps = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(opt.param_groups[0]["lr"]))
    loop = TrainLoop(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=batches,
        steps_per_epoch=iterations,
        prepare=BatchPreparer(process_group, [0.5] * 3, [0.25] * 3),
        autocast=autocast_factory(process_group),
        meter=LossMeter(process_group, learning_rate=0.1, effective_lr=0.1),
        events=NullEventWriter(),
        hooks=Hooks(),
        device=process_group,
        epochs=epochs,
        total_steps=total,
        print_frequency=3,
        is_primary=False,
    )
    for epoch in (1, 2):
        summary = loop.train_epoch(epoch)
        assert summary.images == 4 * iterations
    assert len(steps) == total
    assert loop.step == total == scheduler.last_epoch
    assert steps == pytest.approx([lr_at(s, total, iterations, 0.1) for s in range(total)])
    assert optimizer.param_groups[0]["lr"] == 0.0
