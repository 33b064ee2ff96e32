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

from typing import Any

import httpx

from torchyard.apiclient.admin import AdminCalls
from torchyard.apiclient.audit import AuditCalls
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
from torchyard.apiclient.teams import TeamCalls
from torchyard.apiclient.transport import ProgressCallback, ServiceUnreachableError, Transport, segment
from torchyard.apiclient.webhooks import WebhookCalls
from torchyard.apiclient.weights import WeightsCalls

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


class Client(
    AdminCalls,
    AuditCalls,
    DatasetCalls,
    CodeCalls,
    JobCalls,
    SweepCalls,
    StreamCalls,
    ModelDownloads,
    RegistryCalls,
    WeightsCalls,
    WebhookCalls,
    TeamCalls,
):
    """The torchyard API over HTTP.

    ``url`` and ``token`` default to ``TORCHYARD_URL``/``TORCHYARD_TOKEN``, then to a local
    service (``http://127.0.0.1:8000`` and the data directory's ``admin.token``).

    Each area of the API is one class of :mod:`torchyard.apiclient` sharing the connection
    (admin, datasets, code, jobs, sweeps, streams, model downloads, the registry, teams); the client
    is all of them, so a route's method is written once, in its area.
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
        self.token = resolve_token(token, self.url)
        self._transport = Transport(self.url, self.token, timeout=timeout, transport=transport)

    # -- the areas, by name (each is the client itself)

    @property
    def admin(self) -> AdminCalls:
        return self

    @property
    def datasets(self) -> DatasetCalls:
        return self

    @property
    def code(self) -> CodeCalls:
        return self

    @property
    def jobs(self) -> JobCalls:
        return self

    @property
    def sweeps(self) -> SweepCalls:
        return self

    @property
    def streams(self) -> StreamCalls:
        return self

    @property
    def models(self) -> ModelDownloads:
        return self

    @property
    def registry(self) -> RegistryCalls:
        return self

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

    # -- what needs more than one area

    def wait(self, job_id: str, *, timeout: float | None = None) -> Job:
        """Block until the job is final (following its status events) and return it.

        Raises ``TimeoutError`` if it is not final after ``timeout`` seconds."""
        for _event in self.events(job_id, metrics=False, logs=False, timeout=timeout):
            pass
        return self.get_job(job_id)

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

    def job_result(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}/result``: an evaluation's figures, a training job's summary."""
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{segment(job_id)}/result")
        return result
