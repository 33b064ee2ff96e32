"""The agent's HTTP client of the worker routes (worker token; lease header on placement writes)."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from torchyard.contract.errors import error_from_body
from torchyard.contract.failures import FailureReport
from torchyard.contract.headers import AGENT_KEY_HEADER, LEASE_HEADER
from torchyard.contract.protocol import (
    CLAIMED_PLACEMENT,
    EvaluatePlacement,
    HeartbeatRequest,
    HeartbeatResponse,
    LaunchCheckIn,
    NodeRegister,
    NodeRegistered,
    PlacementStatusReport,
    PlacementStatusResponse,
    ScriptPlacement,
    TrainPlacement,
)
from worker.agent.retry import Backoff, is_retryable, retrying

log = logging.getLogger(__name__)

__all__ = ["Backoff", "WorkerApi", "is_retryable", "retrying"]


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
    def _json(response: httpx.Response) -> object:
        if response.status_code >= 400:
            try:
                body: object = response.json()
            except ValueError:
                body = response.text
            raise error_from_body(response.status_code, body)
        answer: object = response.json()
        return answer

    def register(
        self, name: str, address: str, units: int, accelerator: str, info: dict[str, Any]
    ) -> NodeRegistered:
        body = NodeRegister(
            name=name,
            address=address,
            units=units,
            accelerator=accelerator,
            info=info,
            agent_key=self.agent_key,
        )
        response = self.client.post("/v1/worker/nodes", json=body.model_dump(mode="json"))
        return NodeRegistered.model_validate(self._json(response))

    def heartbeat(self, name: str, leases: list[str], timeout: float) -> HeartbeatResponse:
        body = HeartbeatRequest(leases=leases)
        response = self.client.post(
            f"/v1/worker/nodes/{name}/heartbeat", json=body.model_dump(mode="json"), timeout=timeout
        )
        return HeartbeatResponse.model_validate(self._json(response))

    def drain(self, name: str) -> None:
        """The node takes no new work (the agent got SIGTERM); 404 from an API without the route."""
        self._json(self.client.post(f"/v1/worker/nodes/{name}/drain", timeout=10.0))

    def claim(self, name: str, wait: float) -> TrainPlacement | ScriptPlacement | EvaluatePlacement | None:
        """Long-poll for work: the placement (of its job's kind), or None when ``wait`` ran out."""
        response = self.client.post(
            f"/v1/worker/nodes/{name}/claim",
            params={"wait": wait},
            timeout=httpx.Timeout(wait + 30.0, connect=10.0),
        )
        if response.status_code == 204:
            return None
        return CLAIMED_PLACEMENT.validate_python(self._json(response))

    def check_in(
        self, attempt_id: str, body: LaunchCheckIn
    ) -> TrainPlacement | ScriptPlacement | EvaluatePlacement:
        """A one-placement launcher takes its node rank's placement of ``attempt_id``."""
        response = self.client.post(
            f"/v1/worker/attempts/{attempt_id}/check-in", json=body.model_dump(mode="json")
        )
        return CLAIMED_PLACEMENT.validate_python(self._json(response))

    def launch_heartbeat(
        self, attempt_id: str, node: str, leases: list[str], timeout: float
    ) -> HeartbeatResponse:
        """A launcher renews its placement's lease; the answer's ``stop`` lists stop orders."""
        response = self.client.post(
            f"/v1/worker/attempts/{attempt_id}/heartbeat",
            params={"node": node},
            json=HeartbeatRequest(leases=leases).model_dump(mode="json"),
            timeout=timeout,
        )
        return HeartbeatResponse.model_validate(self._json(response))

    def report_status(
        self,
        lease_token: str,
        state: str,
        *,
        exit_code: int | None = None,
        failure: FailureReport | None = None,
    ) -> PlacementStatusResponse:
        body = PlacementStatusReport.model_validate(
            {"state": state, "exit_code": exit_code, "failure": failure}
        )
        response = self.client.post(
            "/v1/worker/placements/status",
            json=body.model_dump(mode="json"),
            headers={LEASE_HEADER: lease_token},
        )
        return PlacementStatusResponse.model_validate(self._json(response))
