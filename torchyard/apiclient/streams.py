"""Following a job as it runs: its log text and its server-sent events, with resume."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import httpx

from torchyard.apiclient.models import Event
from torchyard.apiclient.transport import Reconnects, Transport, segment
from torchyard.contract.errors import ServiceUnavailableError

IDLE_READ_TIMEOUT_S = 60.0
"""The service sends a comment line every 15 s while nothing happens: a read timeout
well above that means the connection is dead."""


def parse_sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str, str]]:
    """(id, event, data) of each event in an SSE line stream; comments are skipped."""
    event_id: str | None = None
    kind = "message"
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield event_id, kind, "\n".join(data)
            event_id, kind, data = None, "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            data.append(value)
        elif field == "event":
            kind = value
        elif field == "id":
            event_id = value


def log_params(
    rank: int | None,
    stream: str | None,
    offset: int,
    attempt: int | None = None,
    *,
    tail: int | None = None,
    since: datetime | None = None,
) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if tail is not None:
        params["tail"] = tail
    if since is not None:
        params["since"] = since.isoformat()
    if attempt is not None:
        params["attempt"] = attempt
    if stream is not None:
        params["stream"] = stream
    else:
        params["rank"] = 0 if rank is None else rank
    if offset:
        params["offset"] = offset
    return params


class EventFollower:
    """The events of one job until its final one, resuming a dropped stream by event id."""

    def __init__(
        self,
        transport: Transport,
        job_id: str,
        params: dict[str, Any],
        *,
        last_event_id: str | None,
        timeout: float | None,
        reconnects: int,
    ) -> None:
        self._transport = transport
        self._job_id = job_id
        self._params = params
        self._position = last_event_id
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._reconnects = Reconnects(transport, reconnects)

    def __iter__(self) -> Iterator[Event]:
        while True:
            try:
                for event in self._connect():
                    yield event
                    if event.is_final:
                        return
                # The stream closed before the final status: resume where it stopped.
            except (httpx.TransportError, httpx.StreamError, ServiceUnavailableError) as exc:
                if self._past_deadline():
                    raise self._timed_out() from exc
                self._reconnects.failed(exc)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _timed_out(self) -> TimeoutError:
        return TimeoutError(f"job {self._job_id} is not over after {self._timeout} s")

    def _read_timeout(self) -> float:
        if self._deadline is None:
            return IDLE_READ_TIMEOUT_S
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise self._timed_out()
        return min(IDLE_READ_TIMEOUT_S, remaining)

    def _connect(self) -> Iterator[Event]:
        read_timeout = self._read_timeout()
        headers = {"Accept": "text/event-stream"}
        if self._position:
            headers["Last-Event-ID"] = self._position
        with self._transport.stream(
            "GET",
            f"/v1/jobs/{segment(self._job_id)}/events",
            params=self._params,
            headers=headers,
            timeout=self._transport.read_timeout(read_timeout),
        ) as response:
            for event_id, kind, data in parse_sse(response.iter_lines()):
                self._reconnects.succeeded()
                if event_id:
                    self._position = event_id
                yield Event(id=event_id, kind=kind, data=json.loads(data) if data else {})


class StreamCalls:
    """A job's logs (whole or followed) and its event stream."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        stream: str | None = None,
        offset: int = 0,
        attempt: int | None = None,
        tail: int | None = None,
        since: datetime | None = None,
    ) -> str:
        """The log text of one stream (rank ``rank``, default 0; or ``stream``, e.g. the agent log)
        of attempt ``attempt`` (default: the latest); only its last ``tail`` lines, or the text
        that arrived ``since`` a time, when given."""
        params = log_params(rank, stream, offset, attempt, tail=tail, since=since)
        return self._transport.request("GET", f"/v1/jobs/{segment(job_id)}/logs", params=params).text

    def follow_logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        stream: str | None = None,
        offset: int = 0,
        reconnects: int = 20,
        attempt: int | None = None,
        tail: int | None = None,
        since: datetime | None = None,
    ) -> Iterator[str]:
        """Log text as it arrives, until the job ends (or attempt ``attempt`` ends); reconnects
        where it left off. Following the latest attempt, a restarted job's next attempt follows.
        ``tail``/``since`` start at the last lines, or at the text that arrived since a time."""
        position = offset
        if tail is not None or since is not None:
            # Where the last lines (or the text since) begin: then follow from there.
            probe = self._transport.request(
                "GET",
                f"/v1/jobs/{segment(job_id)}/logs",
                params={
                    **log_params(rank, stream, offset, attempt, tail=tail, since=since),
                    "limit_bytes": 1,
                },
            )
            position = int(probe.headers.get("X-Offset", offset))
        retry = Reconnects(self._transport, reconnects)
        while True:
            params = {**log_params(rank, stream, position, attempt), "follow": "true"}
            try:
                with self._transport.stream(
                    "GET",
                    f"/v1/jobs/{segment(job_id)}/logs",
                    params=params,
                    timeout=self._transport.read_timeout(None),
                ) as response:
                    for chunk in response.iter_bytes():
                        position += len(chunk)
                        retry.succeeded()
                        yield chunk.decode("utf-8", errors="replace")
                return
            except (httpx.TransportError, httpx.StreamError, ServiceUnavailableError) as exc:
                retry.failed(exc)

    def events(
        self,
        job_id: str,
        *,
        last_event_id: str | None = None,
        metrics: bool = True,
        logs: bool = True,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
        reconnects: int = 20,
    ) -> Iterator[Event]:
        """Server-sent events of a job, until its final status (the last event).

        A dropped connection is resumed from the last event id, so no event is lost
        or repeated. ``metrics``/``logs`` select the kinds beside status changes;
        ``ranks`` limits the log streams. With ``timeout``, ``TimeoutError`` is raised
        when the job is not over after that many seconds.
        """
        params: dict[str, Any] = {"metrics": str(metrics).lower(), "logs": str(logs).lower()}
        if ranks is not None:
            params["rank"] = list(ranks)
        yield from EventFollower(
            self._transport,
            job_id,
            params,
            last_event_id=last_event_id,
            timeout=timeout,
            reconnects=reconnects,
        )
