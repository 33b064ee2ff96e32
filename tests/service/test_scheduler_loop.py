"""The replica's scheduling loop: passes out of the request path, coalesced and paced.

Real passes of the built-in gang scheduler on a migrated SQLite database; the engine is
wrapped only to note when each pass starts."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from service.config import Settings
from service.db.engine import Database
from service.engines.agents import AgentsDriver
from service.services.reconciler import Reconciler
from service.services.scheduler import PassResult
from service.services.scheduler_loop import SchedulerLoop
from service.services.wakeup import Wakeup

GAP_S = 0.3


class NotingEngine(Reconciler):
    """The built-in engine, noting when each of its passes starts."""

    def __init__(self) -> None:
        super().__init__(AgentsDriver())
        self.starts: list[float] = []

    def run_pass(self, db: Database, settings: Settings) -> PassResult:
        self.starts.append(time.monotonic())
        return super().run_pass(db, settings)


def test_a_stream_of_requests_costs_a_pass_per_gap_and_a_lone_request_is_passed_for_at_once(
    sqlite_url: str, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "data", database_url=sqlite_url)
    db = Database(sqlite_url)
    engine = NotingEngine()
    loop = SchedulerLoop(db, settings, Wakeup(), engine, gap_s=GAP_S).start()
    try:
        # 60 requests, one every 25 ms (1.5 s): about one pass per gap, not one per request.
        stream_from = time.monotonic()
        for _ in range(60):
            loop.request()
            time.sleep(0.025)
        last = loop.request()
        stream_to = time.monotonic()
        deadline = time.monotonic() + 5
        while loop.pending() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.pending() is None, "the last request was never covered by a pass"
        streamed = list(engine.starts)
        gaps = [b - a for a, b in itertools.pairwise(streamed)]
        assert all(g >= GAP_S - 0.01 for g in gaps), gaps
        most = int((stream_to - stream_from) / GAP_S) + 2
        assert 3 <= len(streamed) <= most, (len(streamed), most)
        assert loop.passes == len(streamed) and last <= 61

        # After a quiet spell longer than the gap, a request is passed for at once.
        time.sleep(GAP_S + 0.1)
        asked = time.monotonic()
        loop.request()
        deadline = time.monotonic() + 5
        while len(engine.starts) == len(streamed) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(engine.starts) == len(streamed) + 1
        assert engine.starts[-1] - asked < GAP_S / 2, engine.starts[-1] - asked
    finally:
        loop.stop()
        db.dispose()
