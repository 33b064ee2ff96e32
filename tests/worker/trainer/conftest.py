"""Fixtures of the trainer tests: the real digits written once per session, and the
environment of an in-process (one rank) run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.trainer_helpers import Digits, single_process_env
from torchyard.sample_data import write_digits


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Digits:
    """Real handwritten digits, 30 per class (24 train / 6 validation), 32 px."""
    train, val = write_digits(tmp_path_factory.mktemp("digits"), per_class=30, size=32)
    return Digits(train, val)


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Environment for an in-process run: one rank, no torchrun variables, no injected faults."""
    with single_process_env(monkeypatch):
        yield
