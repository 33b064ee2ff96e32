"""A typed Python client for the torchyard API, built on httpx.

Every route of the user-facing API has a method here. API errors are raised again as
the exceptions of :mod:`torchyard.contract.errors`, carrying the service's machine-readable
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

from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from torchyard.apiclient.admin import AdminCalls
from torchyard.apiclient.code import CodeCalls
from torchyard.apiclient.connection import (
    DEFAULT_DATA_DIR,
    DEFAULT_URL,
    data_dir,
    missing_token_message,
    resolve_token,
    resolve_url,
)
from torchyard.apiclient.datasets import AMBIGUOUS, DatasetCalls, pack_directory
from torchyard.apiclient.jobs import JobCalls
from torchyard.apiclient.model_download import MAX_MODEL_UNPACKED_BYTES, ModelDownloads
from torchyard.apiclient.models import (
    FINAL_STATUSES,
    ApiModel,
    Attempt,
    Cluster,
    CodePackage,
    CreatedToken,
    Dataset,
    Event,
    Failure,
    Job,
    JobComparison,
    MetricPage,
    MetricPoint,
    Node,
    NodeDrained,
    Page,
    StatusChange,
    TokenInfo,
)
from torchyard.apiclient.registry import ModelVersion, RegisteredModel, RegistryCalls
from torchyard.apiclient.streams import StreamCalls
from torchyard.apiclient.sweeps import Sweep, SweepCalls, Trial
from torchyard.apiclient.transport import ProgressCallback, ServiceUnreachableError, Transport, segment

__all__ = [
    "AMBIGUOUS",
    "DEFAULT_DATA_DIR",
    "DEFAULT_URL",
    "FINAL_STATUSES",
    "MAX_MODEL_UNPACKED_BYTES",
    "ApiModel",
    "Attempt",
    "Client",
    "Cluster",
    "CodePackage",
    "CreatedToken",
    "Dataset",
    "Event",
    "Failure",
    "Job",
    "JobComparison",
    "MetricPage",
    "MetricPoint",
    "ModelVersion",
    "Node",
    "NodeDrained",
    "Page",
    "ProgressCallback",
    "RegisteredModel",
    "ServiceUnreachableError",
    "StatusChange",
    "Sweep",
    "TokenInfo",
    "Trial",
    "data_dir",
    "missing_token_message",
    "pack_directory",
    "resolve_token",
    "resolve_url",
]


class Client:
    """The torchyard API over HTTP.

    ``url`` and ``token`` default to ``TORCHYARD_URL``/``TORCHYARD_TOKEN``, then to a local
    service (``http://127.0.0.1:8000`` and the data directory's ``admin.token``).

    Each area of the API is one part sharing the connection — ``admin``, ``datasets``,
    ``jobs``, ``streams``, ``models`` (downloads) and ``registry`` (registered models and
    scoring) — and every call is also a method here.
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
        self._transport = Transport(self.url, self.token, timeout=timeout, transport=transport)
        self.admin = AdminCalls(self._transport)
        self.datasets = DatasetCalls(self._transport)
        self.jobs = JobCalls(self._transport)
        self.streams = StreamCalls(self._transport)
        self.code = CodeCalls(self._transport)
        self.models = ModelDownloads(self._transport, lambda job_id: self.get_job(job_id).model_sha256)
        self.registry = RegistryCalls(self._transport)
        self.sweeps = SweepCalls(self._transport)

    # -- plumbing

    @property
    def _http(self) -> httpx.Client:
        return self._transport.http

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._transport.request(method, path, **kwargs)

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._transport.json(method, path, **kwargs)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- service

    def health(self) -> dict[str, Any]:
        """``GET /healthz`` (needs no token)."""
        return self.admin.health()

    def whoami(self) -> dict[str, Any]:
        return self.admin.whoami()

    def create_token(self, name: str, role: str = "user") -> CreatedToken:
        """Create a token (admin only); the plain token is in the result, shown once."""
        return self.admin.create_token(name, role)

    def list_tokens(self, *, include_revoked: bool = True) -> list[TokenInfo]:
        """Every token (admin only): id, name, role, created, last used, revoked."""
        return self.admin.list_tokens(include_revoked=include_revoked)

    def revoke_token(self, token_id: str) -> TokenInfo:
        """Revoke a token (admin only, idempotent): it gets 401 from now on."""
        return self.admin.revoke_token(token_id)

    def cluster(self) -> Cluster:
        """Nodes, their processing units and health, and the cluster's limits."""
        return self.admin.cluster()

    def drain_node(self, node: str) -> NodeDrained:
        """Drain a node by id or name (admin only): no new work; its jobs checkpoint and requeue."""
        return self.admin.drain_node(node)

    def undrain_node(self, node: str) -> NodeDrained:
        """Make a drained node ready again (admin only)."""
        return self.admin.undrain_node(node)

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
        return self.datasets.upload_dataset(path, name, progress=progress, timeout=timeout)

    def register_dataset(self, name: str, path: str, **options: Any) -> Dataset:
        """Register a folder on shared storage (under one of the service's dataset roots)."""
        return self.datasets.register_dataset(name, path, **options)

    def list_datasets(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Dataset]:
        return self.datasets.list_datasets(limit=limit, cursor=cursor)

    def iter_datasets(self) -> Iterator[Dataset]:
        """Every dataset visible to the token, following the pages."""
        return self.datasets.iter_datasets()

    def get_dataset(self, dataset_id: str) -> Dataset:
        return self.datasets.get_dataset(dataset_id)

    def delete_dataset(self, dataset_id: str) -> None:
        """Delete a dataset (409 ``ConflictError`` while a live job uses it)."""
        self.datasets.delete_dataset(dataset_id)

    def find_dataset(self, ref: str) -> Dataset:
        """A dataset by id, name or unique id prefix; of several with that exact name, the newest."""
        return self.datasets.find_dataset(ref)

    # -- code packages and outputs (script jobs)

    def upload_code(self, folder: str | Path, name: str | None = None) -> CodePackage:
        """Upload a source folder as a code package: the WHOLE folder is sent, except hidden
        entries and what its ``.torchyardignore`` (gitignore syntax) leaves out."""
        return self.code.upload_code(folder, name)

    def list_code(self, *, limit: int | None = None, cursor: str | None = None) -> Page[CodePackage]:
        return self.code.list_code(limit=limit, cursor=cursor)

    def get_code(self, code_id: str) -> CodePackage:
        return self.code.get_code(code_id)

    def delete_code(self, code_id: str) -> None:
        """Delete a code package (409 ``ConflictError`` while a live job uses it)."""
        self.code.delete_code(code_id)

    def download_outputs(self, job_id: str, dest: str | Path, *, path: str | None = None) -> Path:
        """A script job's outputs as .tar.gz (or one file with ``path``), checked against its sha256."""
        return self.code.download_outputs(job_id, dest, path=path)

    # -- jobs

    def submit_job(self, spec: Mapping[str, Any]) -> Job:
        """Submit a job spec (SPEC §5 shape); returns the normalized job, status ``queued``."""
        return self.jobs.submit_job(spec)

    def list_jobs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[Job]:
        return self.jobs.list_jobs(status=status, limit=limit, cursor=cursor)

    def iter_jobs(self, *, status: str | Sequence[str] | None = None) -> Iterator[Job]:
        return self.jobs.iter_jobs(status=status)

    def get_job(self, job_id: str) -> Job:
        return self.jobs.get_job(job_id)

    def cancel_job(self, job_id: str) -> Job:
        """Idempotent cancel; the job ends ``cancelled`` once its ranks are stopped."""
        return self.jobs.cancel_job(job_id)

    def update_job(self, job_id: str, **fields: Any) -> Job:
        """Set a job's ``tags`` (the list replaces the job's) and/or ``note`` (None clears it)."""
        return self.jobs.update_job(job_id, **fields)

    def delete_job(self, job_id: str) -> dict[str, Any]:
        """Delete a finished job with its metrics, logs, checkpoints and files (409 while it
        runs, or while its model is a registered model version)."""
        return self.jobs.delete_job(job_id)

    def clone_job(self, job_id: str) -> Job:
        """Submit a job's spec again as a new job; returns the new job, status ``queued``."""
        return self.jobs.clone_job(job_id)

    def wait(self, job_id: str, *, timeout: float | None = None) -> Job:
        """Block until the job is final (following its status events) and return it.

        Raises ``TimeoutError`` if it is not final after ``timeout`` seconds."""
        for _event in self.events(job_id, metrics=False, logs=False, timeout=timeout):
            pass
        return self.get_job(job_id)

    def compare(
        self, job_ids: Sequence[str], *, metrics: Sequence[str] | None = None, points: int | None = None
    ) -> JobComparison:
        """Up to 20 jobs side by side (ids, names or id prefixes): parameters (``differing``
        names the keys that are not the same in all), and per metric the best and final value
        with its epoch and the reduced series."""
        return self.jobs.compare(job_ids, metrics=metrics, points=points)

    # -- sweeps

    def submit_sweep(self, spec: Mapping[str, Any]) -> Sweep:
        """Start a hyperparameter search (SPEC §15 shape); its first trials are queued as jobs."""
        return self.sweeps.submit_sweep(spec)

    def list_sweeps(
        self,
        *,
        status: str | Sequence[str] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[Sweep]:
        return self.sweeps.list_sweeps(status=status, limit=limit, cursor=cursor)

    def get_sweep(self, sweep_id: str) -> Sweep:
        """The sweep (id, name or id prefix) with every trial and ``best_trial``."""
        return self.sweeps.get_sweep(sweep_id)

    def cancel_sweep(self, sweep_id: str) -> Sweep:
        """Idempotent: no more trials, and every live trial's job is cancelled."""
        return self.sweeps.cancel_sweep(sweep_id)

    def wait_sweep(self, sweep_id: str, *, timeout: float | None = None, poll_s: float = 1.0) -> Sweep:
        """Poll until the sweep is no longer ``running``; ``TimeoutError`` after ``timeout`` s."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            sweep = self.get_sweep(sweep_id)
            if sweep.status != "running":
                return sweep
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"sweep {sweep_id} still running after {timeout} s")
            time.sleep(poll_s)

    # -- metrics, logs, events

    def metrics(
        self,
        job_id: str,
        *,
        name: str | Sequence[str] | None = None,
        after: int | None = None,
        limit: int | None = None,
        include_superseded: bool = False,
    ) -> MetricPage:
        """One page of metric points after the ``after`` cursor (with ``include_superseded``,
        also the points of epochs a later attempt redid)."""
        return self.jobs.metrics(
            job_id, name=name, after=after, limit=limit, include_superseded=include_superseded
        )

    def metric_names(self, job_id: str) -> list[str]:
        """The names of the metrics the job has reported so far."""
        return self.jobs.metric_names(job_id)

    def iter_metrics(
        self, job_id: str, *, name: str | Sequence[str] | None = None, after: int | None = None
    ) -> Iterator[MetricPoint]:
        """Every metric point recorded so far (after ``after``), following the pages."""
        return self.jobs.iter_metrics(job_id, name=name, after=after)

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
        return self.streams.logs(
            job_id, rank=rank, stream=stream, offset=offset, attempt=attempt, tail=tail, since=since
        )

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
        return self.streams.follow_logs(
            job_id,
            rank=rank,
            stream=stream,
            offset=offset,
            reconnects=reconnects,
            attempt=attempt,
            tail=tail,
            since=since,
        )

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
        return self.streams.events(
            job_id,
            last_event_id=last_event_id,
            metrics=metrics,
            logs=logs,
            ranks=ranks,
            timeout=timeout,
            reconnects=reconnects,
        )

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
        return self.models.download_model(
            job_id, dest, progress=progress, keep_archive=keep_archive, on_resume=on_resume
        )

    # -- model registry and scoring

    def register_model(self, name: str, job_id: str, path: str | None = None) -> ModelVersion:
        """Register a succeeded training job's model (or, with ``path``, the model directory in
        that folder of a succeeded script job's outputs) as the next version of ``name``."""
        return self.registry.register_model(name, job_id, path)

    def list_models(self) -> list[RegisteredModel]:
        return self.registry.list_models()

    def get_model(self, name: str) -> RegisteredModel:
        return self.registry.get_model(name)

    def get_model_version(self, name: str, version: str | int = "latest") -> ModelVersion:
        return self.registry.get_model_version(name, version)

    def delete_model_version(self, name: str, version: str | int) -> ModelVersion:
        return self.registry.delete_model_version(name, version)

    def predict(
        self, name: str, images: Sequence[str | Path], *, version: str | int = "latest", top_k: int = 3
    ) -> list[dict[str, Any]]:
        """Score image files with a registered model (the service runs it)."""
        return self.registry.predict(name, version, images, top_k=top_k)

    def job_result(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}/result``: an evaluation's figures, a training job's summary."""
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{segment(job_id)}/result")
        return result
