"""The service's own routes: health, identity, tokens and the cluster."""

from __future__ import annotations

from typing import Any

from torchyard.apiclient.models import Cluster, CreatedToken, NodeDrained, TokenInfo
from torchyard.apiclient.transport import Transport, segment


class AdminCalls:
    """Health, the caller's identity, API tokens (admin only) and the cluster view."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def health(self) -> dict[str, Any]:
        """``GET /healthz`` (needs no token)."""
        body: dict[str, Any] = self._transport.json("GET", "/healthz")
        return body

    def whoami(self) -> dict[str, Any]:
        body: dict[str, Any] = self._transport.json("GET", "/v1/whoami")
        return body

    def create_token(self, name: str, role: str = "user", *, user: str | None = None) -> CreatedToken:
        """Create a token (admin only); the plain token is in the result, shown once. A user
        or admin token acts for ``user`` (default: a new user of the token's name)."""
        request: dict[str, Any] = {"name": name, "role": role}
        if user is not None:
            request["user"] = user
        body = self._transport.json("POST", "/v1/tokens", json=request)
        return CreatedToken.model_validate(body)

    def list_tokens(self, *, include_revoked: bool = True) -> list[TokenInfo]:
        """Every token (admin only): id, name, role, created, last used, revoked."""
        body = self._transport.json(
            "GET", "/v1/tokens", params={"include_revoked": str(include_revoked).lower()}
        )
        return [TokenInfo.model_validate(item) for item in body["items"]]

    def revoke_token(self, token_id: str) -> TokenInfo:
        """Revoke a token (admin only, idempotent): it gets 401 from now on."""
        return TokenInfo.model_validate(self._transport.json("DELETE", f"/v1/tokens/{segment(token_id)}"))

    def cluster(self) -> Cluster:
        """Nodes, their processing units and health, and the cluster's limits."""
        return Cluster.model_validate(self._transport.json("GET", "/v1/cluster"))

    def drain_node(self, node: str) -> NodeDrained:
        """Drain a node by id or name (admin only): no new work; its jobs checkpoint and requeue."""
        body = self._transport.json("POST", f"/v1/cluster/nodes/{segment(node)}/drain")
        return NodeDrained.model_validate(body)

    def undrain_node(self, node: str) -> NodeDrained:
        """Make a drained node ready again (admin only)."""
        body = self._transport.json("POST", f"/v1/cluster/nodes/{segment(node)}/undrain")
        return NodeDrained.model_validate(body)
