"""Shipping a run's metrics, logs and model directory to the API.

:class:`RunReporter` tails, in a background thread, what a placement's ranks write:

* ``<run dir>/events.jsonl`` (metric points, progress, the result; complete lines only);
* each rank's log files (``log_sources()`` is asked every cycle, since torchrun creates
  them late; several files may feed one stream, e.g. a rank's stdout and stderr);
* the agent's own log of the placement (stream ``agent-<node name>``);

and posts them in batches to ``POST /v1/worker/jobs/{id}/reports`` about every half
second, at once when a batch is full. One batch is in flight at a time and is retried,
unchanged, with backoff until the API takes it: file positions only move when a batch
is built, so while the API is down nothing more is read (memory stays bounded by one
batch; the run files on disk are the buffer). Unsent log bytes beyond a bound per stream
are dropped, oldest first, with a note in the stream and a warning in the agent's log;
metric points are never dropped. A retried batch is recognised by the API (metric points by their key, log
chunks by stream and byte offset) so nothing is stored twice. A 409 ``StaleLeaseError``
ends the reporter and sets :attr:`RunReporter.lease_lost`.

Log offsets count the UTF-8 bytes of what was shipped. Invalid UTF-8 and NUL bytes
become U+FFFD; a multi-byte character split by a read waits for its remaining bytes.

:func:`upload_model` packs and uploads the model directory (node rank 0);
:func:`download_model` fetches a succeeded job's model directory for fine-tuning.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from torchyard.contract.errors import StaleLeaseError
from worker.agent.api import Backoff
from worker.agent.model_transfer import (
    LEASE_HEADER,
    download_model,
    is_retryable,
    response_body,
    upload_model,
)
from worker.agent.run_files import (
    DEFAULT_LOG_BACKLOG_BYTES,
    EVENTS_READ_BYTES,
    LOG_READ_BYTES,
    MAX_BATCH_LOG_BYTES,
    MAX_BATCH_LOG_CHUNKS,
    MAX_BATCH_METRICS,
    Batch,
    LogFile,
    RunFileReader,
    _clean_text,
    _utf8_complete_prefix,
)

__all__ = [
    "EVENTS_READ_BYTES",
    "LEASE_HEADER",
    "LOG_READ_BYTES",
    "MAX_BATCH_LOG_BYTES",
    "MAX_BATCH_LOG_CHUNKS",
    "MAX_BATCH_METRICS",
    "RunReporter",
    "_clean_text",
    "_utf8_complete_prefix",
    "download_model",
    "upload_model",
]

log = logging.getLogger(__name__)

# How long a final drain keeps trying once the agent is shutting down.
REPORTER_GIVE_UP_S = 30.0


class RunReporter:
    """Ships one placement's metrics and logs to the API from a background thread.

    ``start()`` begins tailing; ``stop()`` reads everything written so far, ships it and
    ends (call it before reporting the placement's final status: the lease ends there).
    """

    def __init__(
        self,
        client: httpx.Client,
        job_id: str,
        lease_token: str,
        run_dir: Path,
        log_sources: Callable[[], list[tuple[str, Path]]],
        agent_log: Path,
        node_name: str,
        *,
        interval: float = 0.5,
        max_backoff: float = 10.0,
        max_log_backlog: int = DEFAULT_LOG_BACKLOG_BYTES,
        abandon: Callable[[], bool] | None = None,
        metric_sources: Callable[[], list[Path]] | None = None,
        tracking_source: Callable[[], bytes | None] | None = None,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.lease_token = lease_token
        self.reader = RunFileReader(
            job_id,
            run_dir,
            log_sources,
            agent_log,
            node_name,
            metric_sources,
            max_log_backlog=max_log_backlog,
            tracking_source=tracking_source,
        )
        # True once the agent is leaving: a final drain then waits REPORTER_GIVE_UP_S at most.
        self.abandon = abandon or (lambda: False)
        self._backlog_full = False
        self.interval = interval
        self.max_backoff = max_backoff
        self.url = f"/v1/worker/jobs/{job_id}/reports"

        self._stopping = threading.Event()
        self._deadline = math.inf
        self._thread: threading.Thread | None = None
        self._lease_lost = False
        self._drained = False
        self.stats = {"batches": 0, "metrics": 0, "log_bytes": 0, "retries": 0, "dropped_batches": 0}

    @property
    def _files(self) -> dict[Path, LogFile]:
        return self.reader.files

    @property
    def lease_lost(self) -> bool:
        """True once the API answered 409 ``StaleLeaseError``: the reporter has stopped."""
        return self._lease_lost

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("reporter already started")
        self._thread = threading.Thread(target=self._run, name=f"reporter-{self.job_id[:8]}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> bool:
        """Ship everything written so far, then end. True when it all reached the API
        (False when the lease was lost or the API stayed unreachable for ``timeout`` s)."""
        self._deadline = time.monotonic() + timeout
        self._stopping.set()
        if self._thread is None:
            self._run()  # never started: drain in the caller's thread
        else:
            self._thread.join(timeout + 5.0)
            if self._thread.is_alive():
                log.warning("job %s: the reporter did not finish within %.0f s", self.job_id, timeout)
                return False
        return self._drained and not self._lease_lost

    # --- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.reader.close()

    def _loop(self) -> None:
        backoff = Backoff(first=self.interval, cap=self.max_backoff)
        batch: Batch | None = None
        while True:
            final = self._stopping.is_set()
            if batch is None:
                batch = self._next_batch(final)
                if batch is None:
                    if final:
                        self._drained = True
                        return
                    self._stopping.wait(self.interval)
                    continue
            if self._send(batch):
                full = batch.full
                batch = None
                backoff.reset()
                if self._lease_lost:
                    return
                if not final and not full:
                    self._stopping.wait(self.interval)
                continue
            self.stats["retries"] += 1
            if not self._pause_before_retry(batch, backoff.next(), final):
                return

    def _next_batch(self, final: bool) -> Batch | None:
        """What was written since the last batch; None when nothing was."""
        try:
            batch = self.reader.collect(final)
        except Exception:  # a reporting bug must not take the agent down
            log.exception("job %s: reading run files failed", self.job_id)
            batch = Batch()
        return None if batch.empty() else batch

    def _pause_before_retry(self, batch: Batch, delay: float, final: bool) -> bool:
        """Wait ``delay`` before resending ``batch``; False once a final drain is out of time."""
        self._check_backlog()
        if not final:
            self._stopping.wait(delay)
            return True
        if self.abandon():
            self._deadline = min(self._deadline, time.monotonic() + REPORTER_GIVE_UP_S)
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            log.warning(
                "job %s: giving up on %d metric points and %d log bytes: the API stayed unreachable",
                self.job_id,
                len(batch.metrics),
                batch.log_bytes,
            )
            return False
        time.sleep(min(delay, remaining))
        return True

    def _check_backlog(self) -> None:
        """Say once, in the agent's log, when the unsent logs outgrow the bound."""
        if self._backlog_full:
            return
        try:
            backlog = self.reader.backlog()
        except Exception:  # a reporting bug must not take the agent down
            return
        if backlog > self.reader.max_log_backlog:
            self._backlog_full = True
            log.warning(
                "job %s: report buffer full: %d log bytes wait for the API (bound %d per stream); the "
                "oldest unsent log bytes of a stream over the bound are dropped when it is back, with a "
                "note in that stream; metric points are all kept",
                self.job_id,
                backlog,
                self.reader.max_log_backlog,
            )

    def _send(self, batch: Batch) -> bool:
        """Post a batch. True when done with it (stored, refused for good, or lease lost);
        False to retry it later."""
        try:
            response = self.client.post(
                self.url, json=batch.payload(), headers={LEASE_HEADER: self.lease_token}, timeout=30.0
            )
        except httpx.HTTPError as exc:
            log.warning("job %s: report failed (%s), will retry", self.job_id, exc)
            return False
        if response.status_code == 200:
            self.stats["batches"] += 1
            self.stats["metrics"] += len(batch.metrics)
            self.stats["log_bytes"] += batch.log_bytes
            return True
        body = response_body(response)
        code = body.get("code") if isinstance(body, dict) else None
        if response.status_code == 409 and code == StaleLeaseError.code:
            log.warning("job %s: lease lost, reporting stops: %s", self.job_id, body.get("message"))
            self._lease_lost = True
            return True
        if is_retryable(response.status_code):
            log.warning("job %s: report got HTTP %d, will retry", self.job_id, response.status_code)
            return False
        # Retrying a request the API refuses would block every later batch.
        self.stats["dropped_batches"] += 1
        log.error(
            "job %s: the API refused a report batch (HTTP %d): %s", self.job_id, response.status_code, body
        )
        return True
