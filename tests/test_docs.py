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
    # The same command, with the virtual environment cached outside the clone.
    assert re.search(r'^make test VENV="\$venv" \|\| rc=\$\?$', ci, re.M)
    assert "TORCHYARD_REQUIRE_POSTGRES=1" in ci
    # The cache is keyed by pyproject.toml, and a miss installs everything.
    assert 'key="$(sha256sum pyproject.toml' in ci
    assert "pip install --quiet -e '.[all,dev]'" in ci
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet -e '.[all,dev]'" in makefile


def test_gpu_doc_names_every_trainer_gpu_setting_with_its_default() -> None:
    from worker.trainer import gpu_decode

    doc = (ROOT / "docs" / "gpu.md").read_text()
    assert f"| `{gpu_decode.ENV_SWITCH}` | `auto` |" in doc
    assert f"| `{gpu_decode.ENV_CPU_SHARE}` | `{gpu_decode.DEFAULT_CPU_SHARE:g}` |" in doc
    readme = (ROOT / "README.md").read_text()
    assert "pytest -m gpu tests/worker/trainer/test_gpu.py tests/worker/trainer/test_gpu_decode.py" in readme
    assert "(docs/gpu.md)" in readme


def test_restarts_doc_lists_exactly_the_retryable_failures() -> None:
    from torchyard.contract.errors import RETRYABLE_FAILURES
    from torchyard.contract.jobspec import DEFAULT_HANG_TIMEOUT_S, DEFAULT_MAX_RESTARTS

    doc = (ROOT / "docs" / "restarts.md").read_text()
    section = doc.split("### Which failures are retried", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert sorted(listed) == sorted(RETRYABLE_FAILURES)
    assert f"| `max_restarts` | 0–100 | {DEFAULT_MAX_RESTARTS} |" in doc
    assert f"| `hang_timeout_s` | 10–604800, or `null` | {DEFAULT_HANG_TIMEOUT_S} |" in doc
    assert "(docs/restarts.md)" in (ROOT / "README.md").read_text()


def test_operations_doc_names_its_settings_with_their_defaults() -> None:
    from service.config import Settings

    doc = (ROOT / "docs" / "operations.md").read_text()
    rows = re.findall(r"^\| `TORCHYARD_([A-Z_]+)` \| `([^`]+)` \|", doc, re.M)
    assert len(rows) >= 7
    for name, default in rows:
        field = Settings.model_fields[name.lower()]
        assert float(default) == float(field.default), name
    for route in ("GET /healthz", "GET /readyz"):
        assert route in doc
    assert "(docs/operations.md)" in (ROOT / "README.md").read_text()
