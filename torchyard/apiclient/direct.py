"""The client half of direct transfers (:mod:`torchyard.contract.transfer`, docs/storage.md):
agents, launchers and the CLI upload parts straight to the object store with presigned URLs.

The API's own client (its token, lease and agent headers) only asks for the plan and
completes it; the parts go through a client of their own that carries no credential.
A part that fails is retried; URLs that expired (403) are asked for again, which also
tells which parts the store already holds, so an interrupted upload resumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from torchyard.contract.errors import TorchyardError, error_from_body
from torchyard.contract.transfer import PART_BYTES, UploadPlan, UploadRequest, describe_file

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_PLAN_TRIES = 6
_PART_TRIES = 4

ProgressCallback = Callable[[int, int | None], None]


class DirectUploadError(TorchyardError):
    """The object store did not take a part after several tries."""

    code = "DirectUploadError"
    status_code = 502


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:500]


def _part_body(path: Path, offset: int, size: int, progress: Callable[[int], None]) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        fh.seek(offset)
        left = size
        while left > 0:
            chunk = fh.read(min(_CHUNK, left))
            if not chunk:
                raise OSError(f"{path} shrank during its upload")
            left -= len(chunk)
            progress(len(chunk))
            yield chunk


def _ask(
    api: httpx.Client, url: str, request: UploadRequest, headers: dict[str, str], fields: dict[str, Any]
) -> UploadPlan:
    body = {**request.model_dump(exclude_none=True), **fields}
    response = api.post(url, json=body, headers=headers, timeout=httpx.Timeout(60.0, read=300.0))
    if response.status_code >= 400:
        raise error_from_body(response.status_code, _body(response))
    return UploadPlan.model_validate(response.json())


def upload(
    api: httpx.Client,
    plan_url: str,
    path: Path,
    *,
    headers: dict[str, str] | None = None,
    sha256: str | None = None,
    filename: str | None = None,
    part_bytes: int = PART_BYTES,
    progress: ProgressCallback | None = None,
    store: httpx.Client | None = None,
    fields: dict[str, Any] | None = None,
) -> httpx.Response | None:
    """Upload the file ``path`` by the plan the API gives at ``plan_url``.

    Returns the API's answer to the completion (the kind's usual answer), or None when the
    API stores the bytes itself (file storage: ``mode == "api"``): the caller then PUTs the
    body to its route as it always did. The API's refusals raise the matching
    :class:`TorchyardError`. ``fields`` go into the plan's request beside the transfer's
    (what the kind's route needs to record the artifact: a name, a manifest...).
    """
    fields = dict(fields or {})
    headers = dict(headers or {})
    request = describe_file(Path(path), part_bytes, sha256=sha256)
    if filename is not None:
        request = request.model_copy(update={"filename": filename})
    plan = _ask(api, plan_url, request, headers, fields)
    if plan.mode == "api":
        return None
    sent = 0
    total = request.size

    def moved(n: int) -> None:
        nonlocal sent
        sent += n
        if progress is not None:
            progress(sent, total)

    own_store = store is None
    store = store or httpx.Client(timeout=httpx.Timeout(60.0, read=900.0, write=900.0))
    try:
        moved(sum(p.size for p in plan.parts if p.number in plan.done))
        for round_number in range(_PLAN_TRIES):
            if _send_parts(store, Path(path), plan, moved):
                return _complete(api, plan, headers)
            log.info("presigned URLs expired; asking for fresh ones (round %d)", round_number + 2)
            plan = _ask(api, plan_url, request, headers, fields)
    finally:
        if own_store:
            store.close()
    raise DirectUploadError(f"the upload of {path} did not finish after {_PLAN_TRIES} plans")


def _complete(api: httpx.Client, plan: UploadPlan, headers: dict[str, str]) -> httpx.Response:
    assert plan.complete_url is not None
    response = api.post(plan.complete_url, headers=headers, timeout=httpx.Timeout(60.0, read=900.0))
    if response.status_code >= 400:
        raise error_from_body(response.status_code, _body(response))
    return response


def _send_parts(store: httpx.Client, path: Path, plan: UploadPlan, moved: Callable[[int], None]) -> bool:
    """PUT the parts the store does not hold yet; False when their URLs expired."""
    offset = 0
    for part in plan.parts:
        start, offset = offset, offset + part.size
        if part.number in plan.done:
            continue
        if not _put_part(store, path, part.url, part.headers, start, part.size, moved):
            return False
    return True


def _put_part(
    store: httpx.Client,
    path: Path,
    url: str,
    headers: dict[str, str],
    offset: int,
    size: int,
    moved: Callable[[int], None],
) -> bool:
    """PUT one part; False when its URL no longer works (expired: ask for a new plan)."""
    last: Exception | str = ""
    for attempt in range(_PART_TRIES):
        if attempt:
            time.sleep(min(8.0, 0.5 * 2**attempt))
        counted = 0

        def count(n: int) -> None:
            nonlocal counted
            counted += n
            moved(n)

        try:
            response = store.put(url, content=_part_body(path, offset, size, count), headers=headers)
        except httpx.TransportError as exc:
            moved(-counted)
            last = exc
            continue
        if response.status_code < 300:
            return True
        moved(-counted)
        if response.status_code == 403:
            return False
        last = f"HTTP {response.status_code}: {response.text[:300]}"
        if response.status_code < 500 and response.status_code != 408:
            break
    raise DirectUploadError(f"the object store refused a part of {path}: {last}")


def is_direct(api: httpx.Client) -> bool:
    """Whether the API's artifacts go to an object store with presigned URLs (``GET /v1/storage``)."""
    response = api.get("/v1/storage")
    if response.status_code >= 400:
        raise error_from_body(response.status_code, _body(response))
    return bool(response.json().get("direct"))


def api_headers(response: httpx.Response) -> httpx.Headers:
    """The headers the API sent, also when the client followed its redirect to the store."""
    return response.history[0].headers if response.history else response.headers
