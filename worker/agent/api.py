"""The agent's HTTP client of the worker routes (worker token; lease header on placement writes)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from torchyard.contract.errors import TorchyardError, error_from_body
from torchyard.contract.headers import AGENT_KEY_HEADER, LEASE_HEADER
from torchyard.contract.protocol import ClaimedPlacement

log = logging.getLogger(__name__)

T = TypeVar("T")
_RETRY_STATUS = frozenset({408, 425, 429})


def is_retryable(exc: BaseException) -> bool:
    """Worth trying again: the network, or the API's own trouble (5xx, 429...)."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, TorchyardError):
        return exc.status_code >= 500 or exc.status_code in _RETRY_STATUS
    return False


class Backoff:
    """The agent's one retry policy: exponential backoff with jitter, ``first`` seconds
    doubling up to ``cap``; ``reset()`` after a success."""

    def __init__(self, first: float = 0.2, cap: float = 10.0) -> None:
        self.first = first
        self.cap = cap
        self.current = first

    def next(self) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.current * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.current = self.first


def retrying(
    call: Callable[[], T],
    what: str,
    *,
    stop: threading.Event | None = None,
    deadline: float | None = None,
    cap: float = 10.0,
) -> T:
    """``call()`` until it succeeds, raises something not retryable, ``stop`` is set, or
    ``deadline`` (monotonic) passes; the last error is raised then."""
    backoff = Backoff(cap=cap)
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_retryable(exc):
                raise
            delay = backoff.next()
            if (stop is not None and stop.is_set()) or (
                deadline is not None and time.monotonic() + delay > deadline
            ):
                raise
            log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)


class WorkerApi:
    """Calls of one agent. Thread-safe: the heartbeat thread, the claim loop and every
    placement's thread share it (and its connection pool)."""

    def __init__(
        self, base_url: str, token: str, *, agent_key: str | None = None, timeout: float = 30.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.agent_key = agent_key
        headers = {"Authorization": f"Bearer {token}"}
        if agent_key is not None:
            # Proves on every heartbeat and claim that this agent still holds the node.
            headers[AGENT_KEY_HEADER] = agent_key
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            trust_env=False,
        )

    def close(self) -> None:
        self.client.close()

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                body: Any = response.json()
            except ValueError:
                body = response.text
            raise error_from_body(response.status_code, body)
        return response.json()

    def register(self, name: str, address: str, units: int, accelerator: str, info: dict[str, Any]) -> Any:
        body = {"name": name, "address": address, "units": units, "accelerator": accelerator, "info": info}
        if self.agent_key is not None:
            body["agent_key"] = self.agent_key
        return self._json(self.client.post("/v1/worker/nodes", json=body))

    def heartbeat(self, name: str, leases: list[str], timeout: float) -> Any:
        response = self.client.post(
            f"/v1/worker/nodes/{name}/heartbeat", json={"leases": leases}, timeout=timeout
        )
        return self._json(response)

    def drain(self, name: str) -> Any:
        """The node takes no new work (the agent got SIGTERM); 404 from an API without the route."""
        return self._json(self.client.post(f"/v1/worker/nodes/{name}/drain", timeout=10.0))

    def claim(self, name: str, wait: float) -> ClaimedPlacement | None:
        """Long-poll for work: the placement, or None when ``wait`` ran out."""
        response = self.client.post(
            f"/v1/worker/nodes/{name}/claim",
            params={"wait": wait},
            timeout=httpx.Timeout(wait + 30.0, connect=10.0),
        )
        if response.status_code == 204:
            return None
        return ClaimedPlacement.model_validate(self._json(response))

    def check_in(self, attempt_id: str, body: dict[str, Any]) -> ClaimedPlacement:
        """A one-placement launcher takes its node rank's placement of ``attempt_id``."""
        response = self.client.post(f"/v1/worker/attempts/{attempt_id}/check-in", json=body)
        return ClaimedPlacement.model_validate(self._json(response))

    def launch_heartbeat(self, attempt_id: str, node: str, leases: list[str], timeout: float) -> Any:
        """A launcher renews its placement's lease; the answer's ``stop`` lists stop orders."""
        response = self.client.post(
            f"/v1/worker/attempts/{attempt_id}/heartbeat",
            params={"node": node},
            json={"leases": leases},
            timeout=timeout,
        )
        return self._json(response)

    def report_status(
        self,
        lease_token: str,
        state: str,
        *,
        exit_code: int | None = None,
        failure: dict[str, Any] | None = None,
    ) -> Any:
        body: dict[str, Any] = {"state": state, "exit_code": exit_code}
        if failure is not None:
            body["failure"] = failure
        response = self.client.post(
            "/v1/worker/placements/status", json=body, headers={LEASE_HEADER: lease_token}
        )
        return self._json(response)
