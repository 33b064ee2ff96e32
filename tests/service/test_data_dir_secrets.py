"""The data directory's secrets: the SQLite database (and the tokens) readable by their
owner only, also when an older start left the database 0644; ``serve`` non-dumpable."""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
from pathlib import Path

from service.api.app import bootstrap
from service.config import Settings

_PR_GET_DUMPABLE = 3


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_sqlite_database_and_the_admin_token_are_0600(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    db = bootstrap(settings)
    db.dispose()
    database = settings.data_dir / "torchyard.db"
    assert _mode(database) == 0o600 and _mode(settings.admin_token_path) == 0o600
    os.chmod(database, 0o644)  # as an older start left it
    bootstrap(settings).dispose()
    assert _mode(database) == 0o600


def test_serve_makes_itself_non_dumpable() -> None:
    code = (
        "import ctypes; from service.serving import refuse_inspection; refuse_inspection(); "
        f"print(ctypes.CDLL(None).prctl({_PR_GET_DUMPABLE}, 0, 0, 0, 0))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "0"
    assert ctypes.CDLL(None).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1  # this process: dumpable
