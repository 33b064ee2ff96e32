"""One HTTP connection to the API: requests, error mapping and reconnect pacing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx

from torchyard.contract.errors import ServiceUnavailableError, TorchyardError, error_from_body

ProgressCallback = Callable[[int, int | None], None]
"""Called with (bytes done, bytes in total or None) while a transfer runs."""


class ServiceUnreachableError(TorchyardError):
    """The API could not be reached (connection refused, DNS, timeout...)."""

    code = "ServiceUnreachableError"
    status_code = 503


def segment(ref: str) -> str:
    """An id, name or id prefix as one URL path segment."""
    return quote(ref, safe="")


def raise_for(response: httpx.Response) -> None:
    """Raise the API error a failed response carries, as a :mod:`torchyard.contract.errors` exception."""
    if response.is_success:
        return
    if not response.is_closed:
        response.read()
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text[:500]
    error = error_from_body(response.status_code, body)
    if error.details is None and isinstance(body, dict) and isinstance(body.get("errors"), list):
        error.details = body["errors"]  # a validation error: each bad field and its allowed range
    raise error


class Transport:
    """The authenticated HTTP client every part of :class:`torchyard.client.Client` shares."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout: float,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url
        headers = {"User-Agent": "torchyard-client/1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.timeout = timeout
        self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self.http.close()

    def unreachable(self, exc: httpx.TransportError) -> ServiceUnreachableError:
        hint = ""
        if isinstance(exc, httpx.ConnectError):
            hint = (
                "; is `torchyard serve` running there? For a service on another port or host, set "
                "TORCHYARD_URL (or pass --url), e.g. TORCHYARD_URL=http://127.0.0.1:18850"
            )
        return ServiceUnreachableError(
            f"cannot reach the torchyard API at {self.url}: {exc or type(exc).__name__}{hint}"
        )

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self.unreachable(exc) from exc
        raise_for(response)
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    def read_timeout(self, read: float | None) -> httpx.Timeout:
        """The client's timeout with another read timeout (None: wait for data forever)."""
        return httpx.Timeout(self.timeout, read=read)

    @contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A streamed response whose status was checked (transport errors are not mapped)."""
        with self.http.stream(method, path, **kwargs) as response:
            raise_for(response)
            yield response


class Reconnects:
    """Failed connections in a row to a stream: how long to wait, and when to give up."""

    def __init__(self, transport: Transport, limit: int) -> None:
        self._transport = transport
        self._limit = limit
        self._failures = 0

    def succeeded(self) -> None:
        self._failures = 0

    def failed(self, exc: httpx.TransportError | httpx.StreamError | ServiceUnavailableError) -> None:
        """Wait before the next try; past the limit, raise (unreachable for a transport error).

        A 503 ``ServiceUnavailableError`` (the API's database is away) is waited out like a
        dropped connection."""
        self._failures += 1
        if self._failures > self._limit:
            if isinstance(exc, httpx.TransportError):
                raise self._transport.unreachable(exc) from exc
            raise exc
        time.sleep(min(5.0, 0.2 * 2**self._failures))
