"""A typed Python client for the torchyard API, built on httpx.

Every route of the user-facing API has a method here. API errors are raised again as
the exceptions of :mod:`torchyard.errors`, carrying the service's machine-readable
``code`` and HTTP status; a service that cannot be reached raises
:class:`ServiceUnreachableError`. ::

    from torchyard.client import Client

    with Client() as ty:  # URL and token from TORCHYARD_URL / TORCHYARD_TOKEN or the data dir
        train = ty.upload_dataset("digits/train", name="digits-train")
        val = ty.upload_dataset("digits/val", name="digits-val")
        job = ty.submit_job({"model": {"architecture": "resnet18"},
                             "train_dataset": train.id, "validation_dataset": val.id,
                             "parameters": {"image_size": 32, "epochs": 3}})
        for event in ty.events(job.id):
            print(event.kind, event.data)
        ty.download_model(job.id, "digits-model")
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict

from torchyard.errors import (
    InvalidModelDirectoryError,
    TorchyardError,
    error_from_body,
)
from torchyard.model_archive import extract_model_archive

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_DATA_DIR = "./torchyard-data"
FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
MAX_MODEL_UNPACKED_BYTES = 64 * 1024**3
AMBIGUOUS = "AmbiguousReferenceError"
"""The error code of a name or id prefix that matches several of the caller's objects."""

ProgressCallback = Callable[[int, int | None], None]
"""Called with (bytes done, bytes in total or None) while a transfer runs."""


class ServiceUnreachableError(TorchyardError):
    """The API could not be reached (connection refused, DNS, timeout...)."""

    code = "ServiceUnreachableError"
    status_code = 503


# --------------------------------------------------------------------------- connection settings


def data_dir() -> Path:
    """The local data directory: ``TORCHYARD_DATA_DIR`` or ``./torchyard-data``."""
    return Path(os.environ.get("TORCHYARD_DATA_DIR") or DEFAULT_DATA_DIR)


def resolve_url(url: str | None = None) -> str:
    """The API URL: the argument, else ``TORCHYARD_URL``, else the local default."""
    return (url or os.environ.get("TORCHYARD_URL") or DEFAULT_URL).rstrip("/")


def resolve_token(token: str | None = None) -> str | None:
    """The token: the argument, else ``TORCHYARD_TOKEN``, else the local data dir's admin token.

    The last one lets a user of a local ``torchyard serve`` run every command without
    ever copying a token.
    """
    if token:
        return token
    env = os.environ.get("TORCHYARD_TOKEN")
    if env:
        return env.strip()
    path = data_dir() / "admin.token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def missing_token_message() -> str:
    """Why no token was found: where :func:`resolve_token` looked, and how to give one."""
    path = data_dir() / "admin.token"
    try:
        path.read_text()
        why = "is empty"
    except FileNotFoundError:
        why = "does not exist"
    except OSError as exc:
        why = f"cannot be read ({exc.strerror or exc})"
    default = "" if os.environ.get("TORCHYARD_DATA_DIR") else " (TORCHYARD_DATA_DIR is not set: the default is used)"
    return (
        f"no API token: --token and TORCHYARD_TOKEN are not set, and the local service's token file "
        f"{path} {why}{default}. Set TORCHYARD_TOKEN to a token, or TORCHYARD_DATA_DIR to the data "
        "directory of the service you started (e.g. TORCHYARD_DATA_DIR=torchyard-demo/data after the demo)"
    )


# --------------------------------------------------------------------------- response models


class ApiModel(BaseModel):
    """A response body; fields the service adds later are kept, not refused."""

    model_config = ConfigDict(extra="allow")


T = TypeVar("T", bound=ApiModel)


class Page(ApiModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


class Dataset(ApiModel):
    id: str
    name: str
    classes: list[str] = []
    class_counts: dict[str, int] = {}
    num_images: int = 0
    size_bytes: int = 0
    sha256: str = ""
    source: str | None = None
    created_at: datetime | None = None


class Failure(ApiModel):
    code: str
    message: str
    rank: int | None = None
    node: str | None = None
    traceback: str | None = None


class StatusChange(ApiModel):
    status: str
    at: datetime
    message: str | None = None


class Job(ApiModel):
    id: str
    name: str
    status: str
    model: dict[str, Any] = {}
    train_dataset: str | None = None
    validation_dataset: str | None = None
    parameters: dict[str, Any] = {}
    resources: dict[str, Any] = {}
    priority: int = 0
    reason: str | None = None
    failure: Failure | None = None
    progress: dict[str, Any] | None = None
    best: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    model_sha256: str | None = None
    model_size: int | None = None
    nodes: list[str] = []
    history: list[StatusChange] | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES


class MetricPoint(ApiModel):
    seq: int
    name: str
    value: float
    epoch: int
    step: int
    rank: int = 0
    time: datetime | None = None


class MetricPage(ApiModel):
    items: list[MetricPoint]
    next_after: int | None = None


class Node(ApiModel):
    name: str
    address: str = ""
    units: int
    free_units: int
    accelerator: str = "cpu"
    status: str
    last_heartbeat_at: datetime | None = None
    running_attempts: list[str] = []


class Cluster(ApiModel):
    max_nodes: int
    max_units_per_node: int = 0
    ready_nodes: int = 0
    nodes: list[Node] = []


class CreatedToken(ApiModel):
    id: str
    name: str
    role: str
    token: str


class TokenInfo(ApiModel):
    """A token as ``GET /v1/tokens`` lists it: never its secret."""

    id: str
    name: str
    role: str
    created_at: datetime | None = None
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None


@dataclass(frozen=True)
class Event:
    """One server-sent event of ``GET /v1/jobs/{id}/events``.

    ``kind`` is ``status``, ``metric`` or ``log`` (or ``end``, sent instead of a final
    status to a client that resumed after it); ``id`` is the resume position
    (send it back as ``Last-Event-ID``); ``data`` is the decoded JSON payload.
    """

    id: str | None
    kind: str
    data: dict[str, Any]

    @property
    def is_final(self) -> bool:
        return self.kind == "end" or (self.kind == "status" and self.data.get("status") in FINAL_STATUSES)


# --------------------------------------------------------------------------- helpers


def pack_directory(folder: str | Path, dest: IO[bytes]) -> None:
    """Write ``folder`` as a .tar.gz into ``dest``: regular files and folders only.

    The archive holds one wrapping folder named like ``folder``; hidden entries are
    kept out, links and special files skipped (the service refuses them).
    """
    root = Path(folder)
    with tarfile.open(fileobj=dest, mode="w:gz", compresslevel=6) as tar:

        def add(path: Path, arcname: str) -> None:
            info = tar.gettarinfo(str(path), arcname)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isdir():
                info.mode = 0o755
                tar.addfile(info)
            elif info.isreg():
                info.mode = 0o644
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)

        add(root, root.name)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            base = Path(dirpath)
            rel = base.relative_to(root)
            for name in dirnames:
                if not (base / name).is_symlink():
                    add(base / name, str(Path(root.name) / rel / name))
            for name in sorted(filenames):
                if not name.startswith(".") and not (base / name).is_symlink():
                    add(base / name, str(Path(root.name) / rel / name))


def _segment(ref: str) -> str:
    """An id, name or id prefix as one URL path segment."""
    return quote(ref, safe="")


def _etag_digest(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    value = value.removeprefix("W/")
    return value.strip('"') or None


class _ProgressReader:
    """A file wrapper reporting how much of it was read (for upload progress)."""

    def __init__(self, fh: IO[bytes], total: int, progress: ProgressCallback) -> None:
        self._fh = fh
        self._total = total
        self._done = 0
        self._progress = progress

    def read(self, size: int = -1) -> bytes:
        data = self._fh.read(size)
        self._done += len(data)
        self._progress(self._done, self._total)
        return data

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read(1 << 16):
            yield chunk


def _parse_sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str, str]]:
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


# --------------------------------------------------------------------------- the client


class Client:
    """The torchyard API over HTTP.

    ``url`` and ``token`` default to ``TORCHYARD_URL``/``TORCHYARD_TOKEN``, then to a local
    service (``http://127.0.0.1:8000`` and the data directory's ``admin.token``).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = resolve_url(url)
        self.token = resolve_token(token)
        headers = {"User-Agent": "torchyard-client/1"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    # -- plumbing

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _unreachable(self, exc: httpx.TransportError) -> ServiceUnreachableError:
        return ServiceUnreachableError(f"cannot reach the torchyard API at {self.url}: {exc or type(exc).__name__}")

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
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

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        self._raise_for(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    # -- service

    def health(self) -> dict[str, Any]:
        """``GET /healthz`` (needs no token)."""
        body: dict[str, Any] = self._json("GET", "/healthz")
        return body

    def whoami(self) -> dict[str, Any]:
        body: dict[str, Any] = self._json("GET", "/v1/whoami")
        return body

    def create_token(self, name: str, role: str = "user") -> CreatedToken:
        """Create a token (admin only); the plain token is in the result, shown once."""
        return CreatedToken.model_validate(self._json("POST", "/v1/tokens", json={"name": name, "role": role}))

    def list_tokens(self, *, include_revoked: bool = True) -> list[TokenInfo]:
        """Every token (admin only): id, name, role, created, last used, revoked."""
        body = self._json("GET", "/v1/tokens", params={"include_revoked": str(include_revoked).lower()})
        return [TokenInfo.model_validate(item) for item in body["items"]]

    def revoke_token(self, token_id: str) -> TokenInfo:
        """Revoke a token (admin only, idempotent): it gets 401 from now on."""
        from urllib.parse import quote as quote_segment

        return TokenInfo.model_validate(self._json("DELETE", f"/v1/tokens/{quote_segment(token_id, safe='')}"))

    def cluster(self) -> Cluster:
        """Nodes, their processing units and health, and the cluster's limits."""
        return Cluster.model_validate(self._json("GET", "/v1/cluster"))

    # -- datasets

    def upload_dataset(
        self,
        path: str | Path,
        name: str | None = None,
        *,
        progress: ProgressCallback | None = None,
        timeout: float = 3600.0,
    ) -> Dataset:
        """Upload an ImageDirectory: a folder (packed to .tar.gz on the fly, in a temp file)
        or an archive file (.zip, .tar, .tar.gz/.tgz) as it is."""
        source = Path(path)
        name = name or source.name.split(".")[0] or "dataset"
        with tempfile.TemporaryDirectory(prefix="torchyard-upload-") as tmp:
            if source.is_dir():
                archive = Path(tmp) / f"{source.name or 'dataset'}.tar.gz"
                with open(archive, "wb") as out:
                    pack_directory(source, out)
            elif source.is_file():
                archive = source
            else:
                raise FileNotFoundError(f"no such file or folder: {source}")
            total = archive.stat().st_size
            with open(archive, "rb") as fh:
                body: IO[bytes] | _ProgressReader = (
                    _ProgressReader(fh, total, progress) if progress is not None else fh
                )
                files = {"file": (archive.name, body, "application/octet-stream")}
                data = self._json(
                    "POST",
                    "/v1/datasets",
                    data={"name": name},
                    files=files,
                    timeout=httpx.Timeout(self._timeout, read=timeout, write=timeout),
                )
        return Dataset.model_validate(data)

    def register_dataset(self, name: str, path: str, **options: Any) -> Dataset:
        """Register a folder on shared storage (under one of the service's dataset roots)."""
        body = {"name": name, "path": path, **options}
        return Dataset.model_validate(
            self._json("POST", "/v1/datasets", json=body, timeout=httpx.Timeout(self._timeout, read=3600.0))
        )

    def list_datasets(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Dataset]:
        params = {k: v for k, v in {"limit": limit, "cursor": cursor}.items() if v is not None}
        return Page[Dataset].model_validate(self._json("GET", "/v1/datasets", params=params))

    def iter_datasets(self) -> Iterator[Dataset]:
        """Every dataset visible to the token, following the pages."""
        cursor: str | None = None
        while True:
            page = self.list_datasets(limit=200, cursor=cursor)
            yield from page.items
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def get_dataset(self, dataset_id: str) -> Dataset:
        return Dataset.model_validate(self._json("GET", f"/v1/datasets/{_segment(dataset_id)}"))

    def delete_dataset(self, dataset_id: str) -> None:
        """Delete a dataset (409 ``ConflictError`` while a live job uses it)."""
        self._request("DELETE", f"/v1/datasets/{_segment(dataset_id)}")

    def find_dataset(self, ref: str) -> Dataset:
        """A dataset by id, name or unique id prefix; of several with that exact name, the newest."""
        try:
            return self.get_dataset(ref)
        except TorchyardError as exc:
            if exc.status_code != 404 and exc.code != AMBIGUOUS:
                raise
            not_found = exc
        for dataset in self.iter_datasets():
            if dataset.name == ref:
                return dataset
        raise not_found

    # -- jobs

    def submit_job(self, spec: Mapping[str, Any]) -> Job:
        """Submit a job spec (SPEC §5 shape); returns the normalized job, status ``queued``."""
        return Job.model_validate(self._json("POST", "/v1/jobs", json=dict(spec)))

    def list_jobs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[Job]:
        params: dict[str, Any] = {}
        if status:
            params["status"] = [status] if isinstance(status, str) else list(status)
        if limit is not None:
            params["limit"] = limit
        if cursor:
            params["cursor"] = cursor
        return Page[Job].model_validate(self._json("GET", "/v1/jobs", params=params))

    def iter_jobs(self, *, status: str | Sequence[str] | None = None) -> Iterator[Job]:
        cursor: str | None = None
        while True:
            page = self.list_jobs(status=status, limit=200, cursor=cursor)
            yield from page.items
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def get_job(self, job_id: str) -> Job:
        return Job.model_validate(self._json("GET", f"/v1/jobs/{_segment(job_id)}"))

    def cancel_job(self, job_id: str) -> Job:
        """Idempotent cancel; the job ends ``cancelled`` once its ranks are stopped."""
        return Job.model_validate(self._json("POST", f"/v1/jobs/{_segment(job_id)}/cancel"))

    def wait(self, job_id: str, *, timeout: float | None = None) -> Job:
        """Block until the job is final (following its status events) and return it.

        Raises ``TimeoutError`` if it is not final after ``timeout`` seconds."""
        for _event in self.events(job_id, metrics=False, logs=False, timeout=timeout):
            pass
        return self.get_job(job_id)

    # -- metrics, logs, events

    def metrics(
        self,
        job_id: str,
        *,
        name: str | Sequence[str] | None = None,
        after: int | None = None,
        limit: int | None = None,
    ) -> MetricPage:
        """One page of metric points after the ``after`` cursor."""
        params: dict[str, Any] = {}
        if name:
            params["name"] = [name] if isinstance(name, str) else list(name)
        if after is not None:
            params["after"] = after
        if limit is not None:
            params["limit"] = limit
        return MetricPage.model_validate(self._json("GET", f"/v1/jobs/{_segment(job_id)}/metrics", params=params))

    def iter_metrics(
        self, job_id: str, *, name: str | Sequence[str] | None = None, after: int | None = None
    ) -> Iterator[MetricPoint]:
        """Every metric point recorded so far (after ``after``), following the pages."""
        cursor = after
        while True:
            page = self.metrics(job_id, name=name, after=cursor, limit=1000)
            yield from page.items
            if not page.items or page.next_after is None or page.next_after == cursor:
                return
            cursor = page.next_after

    def logs(self, job_id: str, *, rank: int | None = None, stream: str | None = None, offset: int = 0) -> str:
        """The log text of one stream (rank ``rank``, default 0; or ``stream``, e.g. the agent log)."""
        params = self._log_params(rank, stream, offset)
        return self._request("GET", f"/v1/jobs/{_segment(job_id)}/logs", params=params).text

    @staticmethod
    def _log_params(rank: int | None, stream: str | None, offset: int) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if stream is not None:
            params["stream"] = stream
        else:
            params["rank"] = 0 if rank is None else rank
        if offset:
            params["offset"] = offset
        return params

    def follow_logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        stream: str | None = None,
        offset: int = 0,
        reconnects: int = 20,
    ) -> Iterator[str]:
        """Log text as it arrives, until the job ends; reconnects where it left off."""
        position = offset
        failures = 0
        while True:
            params = {**self._log_params(rank, stream, position), "follow": "true"}
            try:
                with self._http.stream(
                    "GET",
                    f"/v1/jobs/{_segment(job_id)}/logs",
                    params=params,
                    timeout=httpx.Timeout(self._timeout, read=None),
                ) as response:
                    self._raise_for(response)
                    for chunk in response.iter_bytes():
                        position += len(chunk)
                        failures = 0
                        yield chunk.decode("utf-8", errors="replace")
                return
            except (httpx.TransportError, httpx.StreamError) as exc:
                failures += 1
                if failures > reconnects:
                    if isinstance(exc, httpx.TransportError):
                        raise self._unreachable(exc) from exc
                    raise
                time.sleep(min(5.0, 0.2 * 2**failures))

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
        deadline = None if timeout is None else time.monotonic() + timeout
        position = last_event_id
        failures = 0
        while True:
            # The service sends a comment line every 15 s while nothing happens: a read
            # timeout well above that means the connection is dead.
            read_timeout = 60.0
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"job {job_id} is not over after {timeout} s")
                read_timeout = min(read_timeout, remaining)
            headers = {"Accept": "text/event-stream"}
            if position:
                headers["Last-Event-ID"] = position
            try:
                with self._http.stream(
                    "GET",
                    f"/v1/jobs/{_segment(job_id)}/events",
                    params=params,
                    headers=headers,
                    timeout=httpx.Timeout(self._timeout, read=read_timeout),
                ) as response:
                    self._raise_for(response)
                    for event_id, kind, data in _parse_sse(response.iter_lines()):
                        failures = 0
                        if event_id:
                            position = event_id
                        event = Event(id=event_id, kind=kind, data=json.loads(data) if data else {})
                        yield event
                        if event.is_final:
                            return
                # The stream closed before the final status: resume where it stopped.
            except (httpx.TransportError, httpx.StreamError) as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job {job_id} is not over after {timeout} s") from exc
                failures += 1
                if failures > reconnects:
                    if isinstance(exc, httpx.TransportError):
                        raise self._unreachable(exc) from exc
                    raise
                time.sleep(min(5.0, 0.2 * 2**failures))

    # -- model

    def download_model(
        self,
        job_id: str,
        dest: str | Path,
        *,
        progress: ProgressCallback | None = None,
        keep_archive: bool = False,
        on_resume: Callable[[int], None] | None = None,
    ) -> Path:
        """Download a succeeded job's model directory into ``dest`` and verify it.

        The archive is written to ``<dest>.tar.gz.part``; an interrupted download is
        resumed from there with an HTTP Range request (if the model is still the same
        one, by its ETag). The complete archive must match its sha256 (the ETag), is
        unpacked safely, and its manifest is verified before ``dest`` appears.
        """
        target = Path(dest)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"{target} already exists and is not empty")
        archive = target.with_name(target.name + ".tar.gz")
        part = archive.with_name(archive.name + ".part")
        target.parent.mkdir(parents=True, exist_ok=True)
        expected = self.get_job(job_id).model_sha256
        digest = self._fetch_archive(job_id, part, expected, progress=progress, on_resume=on_resume)
        if expected and digest != expected:
            part.unlink(missing_ok=True)
            raise InvalidModelDirectoryError(
                f"downloaded model sha256 {digest} does not match the job's {expected}; try again"
            )
        os.replace(part, archive)
        try:
            # Only plain files under model/; the manifest must list the required files and
            # every file must match its checksum, in a temporary sibling that becomes
            # ``target`` once all of it checked out. (No torch import: this stays fast.)
            extract_model_archive(archive, target, max_unpacked_bytes=MAX_MODEL_UNPACKED_BYTES)
        finally:
            if not keep_archive:
                archive.unlink(missing_ok=True)
        return target

    def _fetch_archive(
        self,
        job_id: str,
        part: Path,
        expected: str | None,
        *,
        progress: ProgressCallback | None,
        on_resume: Callable[[int], None] | None,
    ) -> str:
        """Bring ``part`` to the whole archive (resuming it when possible); return its sha256."""
        hasher = hashlib.sha256()
        have = part.stat().st_size if part.exists() else 0
        headers: dict[str, str] = {}
        if have:
            headers["Range"] = f"bytes={have}-"
            if expected:
                headers["If-Range"] = f'"{expected}"'
        path = f"/v1/jobs/{_segment(job_id)}/model"
        try:
            with self._http.stream(
                "GET", path, headers=headers, timeout=httpx.Timeout(self._timeout, read=300.0)
            ) as response:
                if response.status_code == 416 and have:
                    # The part file is not a prefix of this model (or already too long): restart.
                    response.read()
                    part.unlink()
                    return self._fetch_archive(job_id, part, expected, progress=progress, on_resume=on_resume)
                self._raise_for(response)
                etag = _etag_digest(response.headers.get("etag"))
                if expected and etag and etag != expected:
                    raise InvalidModelDirectoryError(f"the service sent model {etag}, expected {expected}")
                resumed = response.status_code == 206 and have > 0
                if resumed:
                    start = int(response.headers.get("content-range", "bytes 0-").split()[1].split("-")[0])
                    if start != have:
                        raise InvalidModelDirectoryError(f"the service resumed at byte {start}, not {have}")
                    with open(part, "rb") as fh:
                        while block := fh.read(1 << 20):
                            hasher.update(block)
                    if on_resume is not None:
                        on_resume(have)
                else:
                    have = 0
                length = response.headers.get("content-length")
                total = have + int(length) if length is not None else None
                done = have
                with open(part, "ab" if resumed else "wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        out.write(chunk)
                        hasher.update(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress(done, total)
                    out.flush()
                    os.fsync(out.fileno())
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        digest = hasher.hexdigest()
        if etag and digest != etag:
            part.unlink(missing_ok=True)
            raise InvalidModelDirectoryError(f"downloaded model sha256 {digest} does not match its ETag {etag}")
        return digest
