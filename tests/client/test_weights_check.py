"""``torchyard weights upload`` checks a state dict's keys and shapes against the architecture
before sending it, where torch is installed (docs/fine-tuning.md)."""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision

from torchyard.commands.weights import check_state_dict


def test_a_state_dict_is_checked_against_its_architecture(tmp_path: Path) -> None:
    file = tmp_path / "squeezenet.pth"
    torch.save(torchvision.models.squeezenet1_0().state_dict(), file)
    assert check_state_dict("squeezenet1_0", file) is None
    problem = check_state_dict("squeezenet1_1", file)
    assert problem is not None and "does not fit squeezenet1_1" in problem and "missing key" in problem
    file.write_bytes(b"not a torch file")
    assert "is not a torch state dict" in (check_state_dict("squeezenet1_0", file) or "")
