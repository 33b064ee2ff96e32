"""The node lock across a quick restart: a new agent of the same node and work directory
waits (``--wait-for-node``) for the earlier one still stopping, instead of exiting with
NodeNameInUseError; without the wait it refuses at once, as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.serving import LOCAL_WORKER_NODE_WAIT_S, LocalWorker
from torchyard.contract.errors import NodeNameInUseError
from worker.agent.identity import NodeLock

HOLDER = """
import sys, time
from pathlib import Path
from worker.agent.identity import NodeLock
lock = NodeLock(Path(sys.argv[1]), "node-a")
lock.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[2]))  # an earlier agent still stopping its runs
"""


def test_a_restarted_agent_waits_for_the_earlier_one_to_finish_stopping(tmp_path: Path) -> None:
    earlier = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), "2"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert earlier.stdout is not None and earlier.stdout.readline().strip() == "held"
        with pytest.raises(NodeNameInUseError, match=f"pid {earlier.pid}"):
            NodeLock(tmp_path, "node-a").acquire()  # no wait: refused at once
        lock = NodeLock(tmp_path, "node-a")
        lock.acquire(wait_s=120)  # taken once the earlier agent exits
        assert earlier.poll() is not None
        assert lock.path.read_text().strip() != str(earlier.pid)
        lock.release()
    finally:
        earlier.kill()
        earlier.wait()


def test_the_embedded_worker_waits_for_its_predecessor(tmp_path: Path) -> None:
    worker = LocalWorker("http://127.0.0.1:1", "t", "n", 1, tmp_path / "w", tmp_path / "w.log")
    cmd = worker.command()
    assert cmd[cmd.index("--wait-for-node") + 1] == str(LOCAL_WORKER_NODE_WAIT_S)
