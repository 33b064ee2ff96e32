"""Job and sweep spec files as the CLI reads them: a YAML alias (``*name``) is refused in
one line, exit status 2, before it can expand; so a "billion laughs" file ends at once."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from torchyard.commands.common import SpecFileError, load_spec

# Nine levels of ten aliases each: 10^9 strings once expanded.
BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def _limit_memory() -> None:
    """The command may not take more than 2 GiB (the expanded bomb would take far more)."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("command", [["submit"], ["sweep", "submit"]])
def test_an_alias_bomb_is_refused_at_once_with_exit_status_2(tmp_path: Path, command: list[str]) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BILLION_LAUGHS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_URL=f"http://127.0.0.1:{free_port()}", TORCHYARD_TOKEN="x")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", *command, str(bomb)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=_limit_memory,
    )
    assert time.monotonic() - started < 30
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == (
        f"error: {bomb}: YAML aliases are not allowed in a spec file "
        "(line 2, column 8: *a): write the value out"
    )


@pytest.mark.parametrize(
    "text",
    [
        "name: x\nparameters: &p {epochs: 2}\nother: *p\n",
        "base: &b {epochs: 2}\nparameters:\n  <<: *b\n",
    ],
)
def test_any_alias_is_refused(tmp_path: Path, text: str) -> None:
    spec = tmp_path / "job.yml"
    spec.write_text(text)
    with pytest.raises(SpecFileError, match="YAML aliases are not allowed in a spec file"):
        load_spec(str(spec))


def test_a_spec_without_aliases_still_loads(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x  # &not-an-anchor *nor-an-alias\nparameters: {epochs: 2, note: '*a'}\n")
    assert load_spec(str(spec)) == {"name": "x", "parameters": {"epochs": 2, "note": "*a"}}


def test_other_spec_file_errors_are_exit_status_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_URL=f"http://127.0.0.1:{free_port()}", TORCHYARD_TOKEN="x")
    for name, text, message in (
        ("broken.yaml", "a: [1, 2\n", "not valid YAML"),
        ("list.yaml", "- 1\n- 2\n", "a job spec must be a mapping"),
        ("broken.json", "{", "not valid JSON"),
    ):
        path = tmp_path / name
        path.write_text(text)
        result = subprocess.run(
            [sys.executable, "-m", "torchyard.cli", "submit", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 2, (name, result.returncode, result.stderr)
        assert result.stderr.startswith(f"error: {path}: ") and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
