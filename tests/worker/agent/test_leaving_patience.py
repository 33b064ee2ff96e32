"""An agent told to go while a placement's last report waits for an unreachable API goes.

While the agent runs, a report waits out an API outage as long as it lasts (the ranks go on
training meanwhile). Once the agent is leaving (SIGTERM's drain, or a shutdown), the wait is cut
to the leaving patience, counted from when it started to leave: before, a drain whose API was
gone kept the placement's thread, and so the agent's process, alive for a day. The API here is
a loopback port nobody listens on: every call is refused, for real.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from worker.agent import run_outcome
from worker.agent.api import WorkerApi
from worker.agent.context import AgentContext
from worker.agent.lease import LeaseSession
from worker.agent.run_outcome import OutcomeReport

PATIENCE_S = 1.0


@pytest.mark.parametrize("event", ["draining", "shutdown"])
def test_a_final_report_stops_waiting_once_the_agent_leaves(
    event: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_outcome, "LEAVING_PATIENCE_S", PATIENCE_S)
    api = WorkerApi(f"http://127.0.0.1:{free_port()}", "token")
    ctx = AgentContext(
        api=api, node_name="n1", work_dir=tmp_path, cpus=1, grace_s=1, socket_ifname=None, lease_timeout_s=0.2
    )
    report = OutcomeReport(
        ctx, LeaseSession(api, "job-1", "lease-1"), lambda kind, why: None, logging.getLogger("test")
    )
    waiting = threading.Thread(target=report.finish, args=("preempted", 0, None), daemon=True)
    try:
        waiting.start()
        # The agent still runs: the report waits out the outage, past the leaving patience.
        time.sleep(2 * PATIENCE_S)
        assert waiting.is_alive()
        getattr(ctx, event).set()
        # It gives up within the patience from that moment (and the backoff's wait in
        # progress, a few seconds at this point).
        waiting.join(10)
        assert not waiting.is_alive(), "the report still waits for the API after the agent left"
        assert report.final_state == "preempted" and not report.recorded
    finally:
        api.close()
