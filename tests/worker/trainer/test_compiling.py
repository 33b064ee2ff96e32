"""torch.compile of the training forward (worker.trainer.compiling): the setting, the ``auto``
rule, and which batches run compiled. The CUDA path (``auto`` deciding after an epoch, a real
compiled ResNet under DDP) is in the GPU-marked test at the end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from worker.trainer.compiling import (
    AUTO_MIN_REMAINING_S,
    CompiledForward,
    compile_setting,
    worth_compiling,
)


def test_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHYARD_COMPILE", raising=False)
    assert compile_setting() == "auto"
    for raw, value in (("on", "on"), ("1", "on"), ("OFF", "off"), ("false", "off"), ("auto", "auto")):
        monkeypatch.setenv("TORCHYARD_COMPILE", raw)
        assert compile_setting() == value
    monkeypatch.setenv("TORCHYARD_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="TORCHYARD_COMPILE must be auto, on or off"):
        compile_setting()


def test_auto_compiles_only_what_is_long_enough_to_pay_back() -> None:
    assert worth_compiling(0.1, int(AUTO_MIN_REMAINING_S / 0.1))
    assert not worth_compiling(0.1, int(AUTO_MIN_REMAINING_S / 0.1) - 1)
    assert not worth_compiling(1.0, 0)


class Recording:
    """A stand-in compiler: counts the calls that go through the 'compiled' path."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, model: nn.Module) -> Callable[..., Any]:
        def compiled(batch: torch.Tensor) -> Any:
            self.calls += 1
            if self.fail:
                raise RuntimeError("backend compiler failed")
            return model(batch)

        return compiled


def test_full_batches_run_compiled_and_a_short_last_batch_eagerly() -> None:
    model = nn.Linear(4, 2)
    compiler = Recording()
    forward = CompiledForward(
        model, setting="on", device=torch.device("cpu"), batch_size=8, compiler=compiler
    )
    assert forward.active
    forward(torch.randn(8, 4))
    forward(torch.randn(8, 4))
    assert compiler.calls == 2
    out = forward(torch.randn(3, 4))  # the shorter last batch: no second compilation for its shape
    assert out.shape == (3, 2) and compiler.calls == 2


def test_off_and_auto_on_the_cpu_never_compile() -> None:
    for setting in ("off", "auto"):
        compiler = Recording()
        forward = CompiledForward(
            nn.Linear(4, 2), setting=setting, device=torch.device("cpu"), batch_size=8, compiler=compiler
        )
        forward.after_epoch(10.0, 10_000)  # a long job: auto still compiles on CUDA only
        forward(torch.randn(8, 4))
        assert not forward.active and compiler.calls == 0


def test_a_model_that_fails_to_compile_trains_on_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(4, 2)
    compiler = Recording(fail=True)
    forward = CompiledForward(
        model, setting="on", device=torch.device("cpu"), batch_size=8, compiler=compiler
    )
    batch = torch.randn(8, 4)
    out = forward(batch)
    assert torch.equal(out, model(batch))
    assert not forward.active and "torch.compile failed" in caplog.text
    forward(batch)
    assert compiler.calls == 1  # not tried again


def test_torch_compile_itself_gives_the_eager_result() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    forward = CompiledForward(
        model,
        setting="on",
        device=torch.device("cpu"),
        batch_size=2,
        compiler=lambda m: torch.compile(m, backend="eager"),
    )
    batch = torch.randn(2, 3, 8, 8)
    assert torch.allclose(forward(batch), model(batch))
    assert forward.active


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)")
def test_auto_compiles_a_long_job_under_ddp_on_cuda() -> None:
    """``auto`` after an epoch that says the rest is long: ResNet-18 under DDP compiled with
    inductor, its training steps agree with the eager ones, a short batch runs eagerly."""
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device("cuda", 0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device).to(memory_format=torch.channels_last)
    ddp = DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=True)
    forward = CompiledForward(ddp, setting="auto", device=device, batch_size=32)
    forward.after_epoch(0.05, 100)  # 5 s left: not worth it
    assert not forward.active
    forward.after_epoch(0.05, 100_000)
    assert forward.active
    batch = torch.randn(32, 3, 64, 64, device=device).contiguous(memory_format=torch.channels_last)
    # Training mode both ways (batch statistics): the mode the job compiles for.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        compiled, eager = forward(batch).float(), ddp(batch).float()
    assert torch.allclose(compiled, eager, atol=0.1, rtol=0.05), (compiled - eager).abs().max()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    targets = torch.randint(0, 10, (32,), device=device)
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(forward(batch), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss) and forward.active
    assert forward(batch[:5]).shape == (5, 10)
