"""BatchNorm statistics recomputed for the weights validated (worker/trainer/batchnorm.py)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from worker.trainer.batchnorm import precise_bn_batches, recompute_batchnorm_stats


class WithAuxHead(nn.Module):
    """A BatchNorm layer on the main path and one on a head used in training mode only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.aux_bn = nn.BatchNorm2d(4)
        self.frozen_bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.frozen_bn(self.drop(self.bn(self.conv(x))))
        return y + self.aux_bn(y) if self.training else y


def test_the_running_statistics_are_the_average_of_the_batches_with_the_current_weights() -> None:
    torch.manual_seed(0)
    model = WithAuxHead().train()
    for _ in range(3):  # moving averages of other weights, and a batch count
        model(torch.randn(8, 3, 5, 5) * 3)
    model.frozen_bn.eval()  # kept as it is, as fine-tuning may keep a layer
    aux = {k: v.clone() for k, v in model.aux_bn.state_dict().items()}
    frozen = {k: v.clone() for k, v in model.frozen_bn.state_dict().items()}
    tracked = model.bn.state_dict()["num_batches_tracked"].clone()
    batches = [torch.randn(8, 3, 5, 5) + i for i in range(4)]
    closed = []

    def feed() -> Iterator[tuple[torch.Tensor, None]]:
        try:
            for batch in batches:
                yield batch, None
        finally:
            closed.append(True)

    rng = torch.get_rng_state()
    used = recompute_batchnorm_stats(model, feed(), max_batches=3)

    assert used == 3 and closed == [True]
    with torch.no_grad():
        features = [model.conv(b) for b in batches[:3]]
    mean = torch.stack([f.mean(dim=(0, 2, 3)) for f in features]).mean(0)
    var = torch.stack([f.transpose(0, 1).flatten(1).var(dim=1) for f in features]).mean(0)
    stats = model.bn.state_dict()
    assert torch.allclose(stats["running_mean"], mean, atol=1e-5)
    assert torch.allclose(stats["running_var"], var, atol=1e-4)
    # Left as they were: the head no batch reached, the step count, the modes, the generators.
    assert all(torch.equal(aux[k], v) for k, v in model.aux_bn.state_dict().items())
    assert all(torch.equal(frozen[k], v) for k, v in model.frozen_bn.state_dict().items())
    assert not model.frozen_bn.training
    assert torch.equal(stats["num_batches_tracked"], tracked)
    assert model.training and model.bn.training and model.bn.momentum == 0.1
    assert torch.equal(torch.get_rng_state(), rng)


def test_no_batch_leaves_the_statistics_and_the_count_of_batches_is_bounded() -> None:
    model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert recompute_batchnorm_stats(model, iter([]), max_batches=4) == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training
    assert precise_bn_batches(32, 44) == 32
    assert precise_bn_batches(16, 15) == 15  # never more than an epoch
    assert precise_bn_batches(4096, 10) == 1
    assert precise_bn_batches(32, 100) == 32
