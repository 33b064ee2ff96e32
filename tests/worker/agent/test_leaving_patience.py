"""An agent told to go while a placement's last report waits for an unreachable API goes.

While the agent runs, a report waits out an API outage as long as it lasts (the ranks go on
training meanwhile). Once the agent is leaving (SIGTERM's drain, or a shutdown), the wait is cut
to the leaving patience, counted from when it started to leave: before, a drain whose API was
gone kept the placement's thread, and so the agent's process, alive for a day. The API here is
a loopback port nobody listens on: every call is refused, for real. The same holds for the
metrics and logs the placement's reporter has not sent yet.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from worker.agent import reporting, run_outcome
from worker.agent.api import WorkerApi
from worker.agent.context import AgentContext
from worker.agent.lease import LeaseSession
from worker.agent.reporting import RunReporter
from worker.agent.run_outcome import OutcomeReport

PATIENCE_S = 1.0


def _context(api: WorkerApi, work_dir: Path) -> AgentContext:
    return AgentContext(
        api=api, node_name="n1", work_dir=work_dir, cpus=1, grace_s=1, socket_ifname=None, lease_timeout_s=0.2
    )


@pytest.mark.parametrize("event", ["draining", "shutdown"])
def test_a_final_report_stops_waiting_once_the_agent_leaves(
    event: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_outcome, "LEAVING_PATIENCE_S", PATIENCE_S)
    api = WorkerApi(f"http://127.0.0.1:{free_port()}", "token")
    ctx = _context(api, tmp_path)
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


def test_the_reporters_final_drain_gives_up_once_the_agent_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reporting, "REPORTER_GIVE_UP_S", PATIENCE_S)
    log_file = tmp_path / "rank-0.log"
    log_file.write_text("epoch 1 step 3 loss 0.5\n")
    api = WorkerApi(f"http://127.0.0.1:{free_port()}", "token")
    ctx = _context(api, tmp_path)
    try:
        reporter = RunReporter(
            api.client,
            "job-1",
            "lease-1",
            tmp_path,
            lambda: [("rank-0", log_file)],
            tmp_path / "agent.log",
            "n1",
            interval=0.05,
            abandon=ctx.leaving,  # as a placement's reporter has it
        )
        reporter.start()
        answer: list[bool] = []
        stopping = threading.Thread(target=lambda: answer.append(reporter.stop(24 * 3600.0)), daemon=True)
        stopping.start()
        # The agent stays: the final drain waits for the API, past the give-up time.
        time.sleep(2 * PATIENCE_S)
        assert stopping.is_alive()
        ctx.draining.set()  # SIGTERM
        stopping.join(15)
        assert answer == [False], "the final drain still waits for the API after the agent left"
    finally:
        api.close()
