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


# References a reader of this repository does not have (the material it was first written
# from): the docs, the examples and the CLI's help speak of torchyard alone.
_FOREIGN_REFERENCES = re.compile(
    r"\bseed \d{3}\b|\bthe seed's\b|\bas the seed\b|\bseeds'|\bpytorch_train\.py\b", re.I
)


def _help_texts() -> list[str]:
    import argparse

    from torchyard.cli import build_parser

    texts: list[str] = []
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        texts.append(parser.format_help())
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return texts


def test_docs_examples_and_help_name_things_for_what_they_are() -> None:
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.*")]
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)!r}"
        for path in files
        if path.suffix in {".md", ".py", ".json", ".yaml", ".yml"}
        for match in _FOREIGN_REFERENCES.finditer(path.read_text())
    ]
    found += [
        f"CLI help: {m.group(0)!r}" for text in _help_texts() for m in _FOREIGN_REFERENCES.finditer(text)
    ]
    assert found == []
    # The fine-tuning example is named for what it does (it trains on any class folders; the
    # docs run it on digits), and every reference to it follows.
    assert not (ROOT / "examples" / "birds").exists()
    assert (ROOT / "examples" / "finetune-resnet" / "train.py").is_file()
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.md")]:
        assert "birds" not in path.read_text(), path
