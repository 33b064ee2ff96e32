"""A node's copy of stored weights (docs/fine-tuning.md): downloaded once, verified against the
claim's sha256, never kept when it does not match; the hub setting."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from torchyard.contract.errors import InvalidModelDirectoryError
from torchyard.contract.headers import SHA256_HEADER
from torchyard.contract.protocol import ClaimedWeights
from worker.agent.weights_cache import fetch_weights, hub_allowed

BODY = b"PK\x03\x04 weights"
SHA = hashlib.sha256(BODY).hexdigest()


def _client(body: bytes, calls: list[str]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, content=body, headers={SHA256_HEADER: SHA})

    return httpx.Client(base_url="http://api", transport=httpx.MockTransport(answer))


def _ref(sha: str = SHA) -> ClaimedWeights:
    return ClaimedWeights(
        id="w1", architecture="resnet18", filename="w.pth", sha256=sha, size_bytes=len(BODY)
    )


def test_weights_are_fetched_once_and_verified(tmp_path: Path) -> None:
    calls: list[str] = []
    with _client(BODY, calls) as client:
        path = fetch_weights(client, _ref(), tmp_path)
        assert path == tmp_path / f"{SHA}.pth" and path.read_bytes() == BODY
        assert fetch_weights(client, _ref(), tmp_path) == path
    assert calls == ["/v1/worker/weights/w1/file"]


def test_a_damaged_download_is_not_kept(tmp_path: Path) -> None:
    with (
        _client(b"PK\x03\x04 damaged", []) as client,
        pytest.raises(InvalidModelDirectoryError, match="checksum"),
    ):
        fetch_weights(client, _ref(), tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / f".{SHA}.lock"]


def test_the_hub_setting() -> None:
    assert hub_allowed({"TORCHYARD_WORKER_PRETRAINED_FROM_HUB": "1"})
    assert not hub_allowed({"TORCHYARD_WORKER_PRETRAINED_FROM_HUB": "0"})
    assert not hub_allowed({})
