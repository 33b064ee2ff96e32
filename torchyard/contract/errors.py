"""The one error hierarchy of torchyard.

Every error carries a machine-readable ``code`` (the contract of docs/api.md) and the
HTTP status it maps to. The API turns them into 4xx bodies in one place; the
worker and trainer use the same codes for job failures; the client raises them
again from API error bodies.
"""

from __future__ import annotations

from typing import Any


class TorchyardError(Exception):
    """Base of every domain error: a code, an HTTP status and a human message."""

    code = "TorchyardError"
    status_code = 400

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details is not None:
            body["details"] = self.details
        return body


class RequestValidationError(TorchyardError):
    """A request body or parameter is malformed or out of range."""

    code = "ValidationError"
    status_code = 422


class InvalidModelDirectoryError(TorchyardError):
    code = "InvalidModelDirectoryError"
    status_code = 422


class InvalidCodeError(TorchyardError):
    """An uploaded code package that cannot be used: unreadable, unsafe or empty archive."""

    code = "InvalidCodeError"
    status_code = 422


class NotLabeledDatasetError(TorchyardError):
    code = "NotLabeledDatasetError"
    status_code = 422


class InvalidDatasetError(TorchyardError):
    code = "InvalidDatasetError"
    status_code = 422


class ResourceLimitError(TorchyardError):
    code = "ResourceLimitError"
    status_code = 422


class PayloadTooLargeError(TorchyardError):
    code = "PayloadTooLargeError"
    status_code = 413


class AuthenticationError(TorchyardError):
    code = "AuthenticationError"
    status_code = 401


class PermissionDeniedError(TorchyardError):
    code = "PermissionDeniedError"
    status_code = 403


class NotFoundError(TorchyardError):
    code = "NotFoundError"
    status_code = 404


class ConflictError(TorchyardError):
    code = "ConflictError"
    status_code = 409


class OutputsNotReadyError(ConflictError):
    """A script job's outputs are asked for before they were uploaded."""

    code = "OutputsNotReadyError"


class IllegalTransitionError(ConflictError):
    code = "IllegalTransitionError"


class StaleLeaseError(ConflictError):
    """A worker wrote with a lease token that is no longer the current one."""

    code = "StaleLeaseError"


class ModelNotReadyError(ConflictError):
    code = "ModelNotReadyError"


class NotBoundYetError(TorchyardError):
    """A launcher checked in before its engine said where every rank of the attempt runs
    (Kubernetes: a pod of the gang not yet on a node): it tries again shortly."""

    code = "NotBoundYetError"
    status_code = 425


class NodeNameInUseError(ConflictError):
    """Another worker token, or another live agent, holds the node name."""

    code = "NodeNameInUseError"


# Job failure codes (docs/api.md). They describe why a job failed; they are raised inside
# the trainer or the worker and recorded on the job, not returned by request handlers.
class TrainingDivergedError(TorchyardError):
    code = "TrainingDivergedError"
    status_code = 422


class WorkerLostError(TorchyardError):
    code = "WorkerLostError"
    status_code = 409


class RankFailedError(TorchyardError):
    code = "RankFailedError"
    status_code = 409


class JobTimeoutError(TorchyardError):
    code = "TimeoutError"
    status_code = 409


class HangError(TorchyardError):
    """No training step finished by any rank for ``resources.hang_timeout_s``."""

    code = "HangError"
    status_code = 409


class RankKilledError(TorchyardError):
    """A rank was ended by a signal (the kernel's OOM killer, an operator's kill)."""

    code = "RankKilledError"
    status_code = 409


class CommunicationError(TorchyardError):
    """A collective or the rendezvous failed between ranks (a peer vanished, a network fault)."""

    code = "CommunicationError"
    status_code = 409


class EnvironmentBuildError(TorchyardError):
    """A script job's ``environment.pip`` could not be installed."""

    code = "EnvironmentBuildError"
    status_code = 422


class SandboxUnavailableError(TorchyardError):
    """A node without a working sandbox (bubblewrap) was given a script job (docs/script-jobs.md)."""

    code = "SandboxUnavailableError"
    status_code = 409


class EngineError(TorchyardError):
    """An engine's job (Slurm's, docs/slurm.md) ended without any report from torchyard's launcher
    (a wrong launcher path, a node without torchyard), or the engine refused it; the message
    carries the engine's state and the tail of its output. Not retried."""

    code = "EngineError"
    status_code = 409


class ServiceUnavailableError(TorchyardError):
    """The API cannot serve the request right now (its database is unreachable); retry later."""

    code = "ServiceUnavailableError"
    status_code = 503


# Which job failures put the job back to ``queued`` to resume from its latest checkpoint
# (docs/restarts.md): the one table, shown in docs/restarts.md. Everything else is final, and so
# is a retryable failure that repeats with the same code and message on two attempts in
# a row.
RETRYABLE_FAILURES: dict[str, str] = {
    WorkerLostError.code: "a node stopped heartbeating (machine died, network cut)",
    HangError.code: "no training step finished for resources.hang_timeout_s",
    RankKilledError.code: "a rank was killed by a signal",
    CommunicationError.code: "a collective or the rendezvous failed between ranks",
}


def is_retryable(code: str | None) -> bool:
    return code in RETRYABLE_FAILURES


ERRORS_BY_CODE: dict[str, type[TorchyardError]] = {
    cls.code: cls
    for cls in (
        TorchyardError,
        RequestValidationError,
        InvalidModelDirectoryError,
        NotLabeledDatasetError,
        InvalidDatasetError,
        InvalidCodeError,
        OutputsNotReadyError,
        ResourceLimitError,
        PayloadTooLargeError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        ConflictError,
        IllegalTransitionError,
        StaleLeaseError,
        ModelNotReadyError,
        NodeNameInUseError,
        TrainingDivergedError,
        WorkerLostError,
        RankFailedError,
        JobTimeoutError,
        HangError,
        RankKilledError,
        CommunicationError,
        EnvironmentBuildError,
        ServiceUnavailableError,
    )
}


def error_from_body(status_code: int, body: Any) -> TorchyardError:
    """Rebuild the error an API error body describes (used by the client)."""
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        cls = ERRORS_BY_CODE.get(body["code"], TorchyardError)
        err = cls(str(body.get("message", "")), details=body.get("details"))
        err.code = body["code"]
    else:
        err = TorchyardError(f"HTTP {status_code}: {body!r}")
    err.status_code = status_code
    return err
