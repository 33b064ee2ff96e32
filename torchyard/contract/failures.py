"""Why a job failed, in its three places: the failure the API shows on a job
(:class:`Failure`), the one a worker agent reports for its node's ranks
(:class:`FailureReport`, strictly validated by the API) and the file a trainer rank leaves
when it fails (:class:`RankFailure`, ``failure-rank-<RANK>.json``)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from torchyard.contract.base import StrictModel

#: The longest message and traceback a report may carry (the agent cuts them to fit).
MAX_FAILURE_MESSAGE = 20_000
MAX_FAILURE_TRACEBACK = 200_000


class Failure(BaseModel):
    """A failure: a torchyard error code (``RankFailedError``, ``WorkerLostError``...), what
    happened, and where it started when that is known."""

    code: str
    message: str
    rank: int | None = None
    node: str | None = None
    traceback: str | None = None


class FailureReport(Failure, StrictModel):
    """A failure as a worker agent reports it for its node (a request body: the API's limits,
    unknown fields refused)."""

    code: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z][A-Za-z0-9]*$")
    message: str = Field(max_length=MAX_FAILURE_MESSAGE)
    rank: int | None = Field(default=None, ge=0)
    node: str | None = Field(default=None, max_length=200)
    traceback: str | None = Field(default=None, max_length=MAX_FAILURE_TRACEBACK)
    secondary: bool = Field(
        default=False, description="The error looks like a consequence of another rank's failure."
    )


class RankFailure(StrictModel):
    """``failure-rank-<RANK>.json``: why a trainer rank failed, written atomically before it
    exits. ``code`` is a torchyard failure code (``TrainingDivergedError``,
    ``InvalidModelDirectoryError``, ``InvalidDatasetError``, else ``RankFailedError``);
    ``secondary`` is True when the error looks like a consequence of another rank's failure (a
    broken collective): the root cause is then the earliest file that is not."""

    code: str
    message: str
    rank: int
    local_rank: int
    node: str
    traceback: str
    time: float = Field(description="When it failed (seconds since the epoch).")
    secondary: bool = False
