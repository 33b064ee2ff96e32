"""Whether the sandbox tests can run here: bubblewrap present and working, or required."""

from __future__ import annotations

import os

import pytest

from worker.agent import sandbox


def require_sandbox() -> None:
    """Skip (with the reason) where this machine has no working bubblewrap, unless
    ``TORCHYARD_REQUIRE_SANDBOX=1`` (CI) makes that a failure."""
    if sandbox.mode({}) == sandbox.BWRAP:
        return
    reason = f"no working bubblewrap here ({sandbox.unavailable_reason()}): the sandbox is not tested"
    if os.environ.get("TORCHYARD_REQUIRE_SANDBOX") == "1":
        pytest.fail(f"TORCHYARD_REQUIRE_SANDBOX=1 but {reason}")
    pytest.skip(reason)
