"""The worker's dataset cache removes what killed downloads left in its staging folder,
and never what a live fetch (another agent on the node) is writing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from worker.agent.dataset_cache import STAGING, remove_interrupted_downloads

SHA_A = "a" * 64
SHA_B = "b" * 64

# A fetch as the agent runs one: hold the dataset's lock, write into a staging folder, wait.
_FETCHER = """
import fcntl, sys, time
from pathlib import Path
cache, sha = Path(sys.argv[1]), sys.argv[2]
lock = open(cache / f".{sha}.lock", "a+b")
fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
work = cache / ".staging" / f"{sha}-0123"
work.mkdir(parents=True)
(work / "dataset.tar").write_bytes(b"x" * 4096)
print("ready", flush=True)
time.sleep(600)
"""


def _start_fetcher(cache: Path, sha: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _FETCHER, str(cache), sha], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def test_a_live_fetch_is_kept_and_a_killed_one_is_swept(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    live = _start_fetcher(cache, SHA_A)
    killed = _start_fetcher(cache, SHA_B)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert remove_interrupted_downloads(cache) == 1
        left = sorted(p.name for p in (cache / STAGING).iterdir())
        assert left == [f"{SHA_A}-0123"], left
        assert (cache / STAGING / f"{SHA_A}-0123" / "dataset.tar").stat().st_size == 4096
    finally:
        live.kill()
        live.wait(10)
    # Its owner gone, the last folder goes too.
    deadline = time.monotonic() + 10
    while remove_interrupted_downloads(cache) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list((cache / STAGING).iterdir()) == []


def test_the_clean_up_leaves_files_it_did_not_write(tmp_path: Path) -> None:
    staging = tmp_path / STAGING
    staging.mkdir()
    (staging / "notes.txt").write_text("kept")
    assert remove_interrupted_downloads(tmp_path) == 0
    assert (staging / "notes.txt").read_text() == "kept"
    assert remove_interrupted_downloads(tmp_path / "missing") == 0
