"""The README and CI script say what the code does."""

from __future__ import annotations

import re
from pathlib import Path

from service.config import settings_reference

ROOT = Path(__file__).resolve().parent.parent


def test_readme_configuration_table_matches_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- settings:begin -->\n(.*?)\n<!-- settings:end -->", readme, re.S)
    assert block is not None
    assert block.group(1) == settings_reference(), "regenerate with: python -m service.config"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)
    assert "TORCHYARD_REQUIRE_POSTGRES=1" in ci
