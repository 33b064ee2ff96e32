"""A placement as a kind sees it (:class:`worker.agent.kinds.base.PlacementHost`), without an
API, a lease or processes: the claimed placement, the agent's context, and fakes of the lease
session and the outcome report that record what the kind asked of them."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any, ClassVar

import pytest

from torchyard.contract.failures import FailureReport
from torchyard.contract.jobfile import JobConfig
from torchyard.contract.protocol import ClaimedPlacement, EvaluatePlacement, ScriptPlacement, TrainPlacement
from worker.agent.context import AgentContext
from worker.agent.kinds import trainer
from worker.agent.rank_group import RankGroup

LOG = logging.getLogger("tests.worker.kinds")


def _common(node_rank: int, node_count: int, nproc: int) -> dict[str, Any]:
    return {
        "job_id": "job1",
        "job_name": "a job",
        "attempt_id": "att1",
        "attempt_number": 2,
        "lease_token": "lease",
        "lease_expires_at": datetime(2030, 1, 1, tzinfo=UTC),
        "node_rank": node_rank,
        "node_count": node_count,
        "process_count_per_node": nproc,
        "world_size": node_count * nproc,
        "master_addr": "10.0.0.7",
        "master_port": 29533,
        "heartbeat_interval_s": 2.0,
        "lease_timeout_s": 15.0,
    }


def _dataset(name: str) -> dict[str, Any]:
    return {"id": name, "sha256": "0" * 64, "classes": ["a", "b"], "num_images": 4}


def train_placement(
    *, node_rank: int = 0, node_count: int = 1, nproc: int = 2, hang_timeout_s: int | None = None
) -> TrainPlacement:
    resources = {"node_count": node_count, "process_count_per_node": nproc, "hang_timeout_s": hang_timeout_s}
    return TrainPlacement.model_validate(
        _common(node_rank, node_count, nproc)
        | {
            "spec": {"model": {"architecture": "resnet18"}, "resources": resources},
            "datasets": {"train": _dataset("train"), "validation": _dataset("val")},
            "classes": ["a", "b"],
        }
    )


def evaluate_placement(*, hang_timeout_s: int | None = None) -> EvaluatePlacement:
    return EvaluatePlacement.model_validate(
        _common(0, 1, 1)
        | {
            "spec": {
                "model": {"architecture": "resnet18"},
                "parameters": {"image_size": 32, "batch_size": 8},
                "resources": {"hang_timeout_s": hang_timeout_s},
            },
            "datasets": {"train": _dataset("val"), "validation": _dataset("val")},
            "classes": ["a", "b"],
            "init_from_job": "trained1",
        }
    )


def script_placement(
    *, node_rank: int = 0, node_count: int = 1, nproc: int = 2, outputs: str = "node0"
) -> ScriptPlacement:
    return ScriptPlacement.model_validate(
        _common(node_rank, node_count, nproc)
        | {
            "spec": {
                "command": ["python", "main.py", "--rank", "$RANK"],
                "outputs": outputs,
                "resources": {"node_count": node_count, "process_count_per_node": nproc},
            },
            "code": {"id": "code1", "sha256": "c" * 64, "files": 2},
        }
    )


class FakeUploader:
    def __init__(self, run_dir: Path, log: logging.Logger) -> None:
        self.run_dir = run_dir
        self.started = False

    def start(self) -> None:
        self.started = True


class FakeSession:
    """The lease session: hands out checkpoint uploaders."""

    def __init__(self) -> None:
        self.uploaders: list[FakeUploader] = []

    def checkpoint_uploader(self, run_dir: Path, log: logging.Logger) -> FakeUploader:
        self.uploaders.append(FakeUploader(run_dir, log))
        return self.uploaders[-1]


class FakeReport:
    """The outcome report: uploads the model directory (answering ``model_failure``) and says
    until when an upload may wait."""

    def __init__(self) -> None:
        self.model_uploads: list[Path] = []
        self.model_failure: FailureReport | None = None

    def upload_model(self, run_dir: Path) -> FailureReport | None:
        self.model_uploads.append(run_dir)
        return self.model_failure

    def outage_deadline(self) -> Any:
        return self.deadline

    @staticmethod
    def deadline() -> float:
        return 1e12


@dataclass
class FakeHost:
    """What a kind uses of its placement (the PlacementHost protocol)."""

    placement: ClaimedPlacement
    ctx: AgentContext
    run_dir: Path
    agent_dir: Path
    node_rank: int
    units: int
    gpu_ids: tuple[int, ...] = ()
    job_id: str = "job1"
    session: Any = field(default_factory=FakeSession)
    report: Any = field(default_factory=FakeReport)
    log: logging.Logger = LOG
    stop_event: threading.Event = field(default_factory=threading.Event)
    stop_kind: Any = None
    preempt_event: threading.Event = field(default_factory=threading.Event)
    group: Any = None
    uploader: Any = None
    watchdog: Any = None
    hang: FailureReport | None = None
    reporters: list[dict[str, Any]] = field(default_factory=list)

    @property
    def work(self) -> ClaimedPlacement:
        return self.placement

    def start_reporter(self, log_sources: Any, agent_log: Path, metric_sources: Any = None, **kw: Any) -> Any:
        self.reporters.append(
            {"log_sources": log_sources, "agent_log": agent_log, "metrics": metric_sources, **kw}
        )
        return "reporter"


@pytest.fixture
def make_host(tmp_path: Path) -> Any:
    """``make_host(placement, **host fields)``: the host of ``placement`` on node ``n1`` of an
    agent with 8 CPUs over 4 units, its run folder under ``<work dir>/runs``."""

    def make(placement: ClaimedPlacement, *, ctx: dict[str, Any] | None = None, **fields: Any) -> FakeHost:
        work_dir = tmp_path / "work"
        settings: dict[str, Any] = {"socket_ifname": None, "node_units": 4} | (ctx or {})
        # The kinds here never call the API themselves: they go through the host's session and report.
        context = AgentContext(
            api=None,  # type: ignore[arg-type]
            node_name="n1",
            work_dir=work_dir,
            cpus=8,
            grace_s=1.0,
            **settings,
        )
        name = f"{placement.job_id}-a{placement.attempt_number}-n1"
        values: dict[str, Any] = {
            "node_rank": placement.node_rank,
            "units": placement.process_count_per_node,
            "run_dir": context.runs_dir / name,
            "agent_dir": context.placements_dir / name,
        }
        values.update(fields)
        host = FakeHost(placement=placement, ctx=context, **values)
        host.run_dir.mkdir(parents=True)
        host.agent_dir.mkdir(parents=True)
        return host

    return make


# --- the trainer's kinds without processes ------------------------------------------------------------


class StartedGroup(RankGroup):
    """torchrun's group with its start recorded instead of made (its command and environment
    are the real ones)."""

    PID = 4242

    def start(self, output: IO[str]) -> int:
        output.write("torchrun would start here\n")
        self.process = SimpleNamespace(pid=self.PID)  # type: ignore[assignment]
        return self.PID


class FakeRunInputs:
    """RunInputs that fetches nothing: it records how it was made and returns the job document
    of the node's caches (``<work dir>/datasets/{train,val}``, ``<work dir>/models/init`` when
    the placement starts from a job's model)."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(
        self, ctx: Any, work: Any, run_dir: Path, stop: Any, log: Any, *, session: Any, task: Any
    ) -> None:
        FakeRunInputs.made.append(
            {"ctx": ctx, "work": work, "run_dir": run_dir, "stop": stop, "log": log, "session": session}
            | {"task": task}
        )
        self.ctx, self.run_dir, self.task, self.work = ctx, run_dir, task, work

    def prepare(self) -> JobConfig:
        work_dir: Path = self.ctx.work_dir
        init = str(work_dir / "models" / "init") if self.work.init_from_job else None
        return JobConfig.model_validate(
            {
                "job_id": self.work.job_id,
                "model": {"architecture": "resnet18"},
                "train_dir": str(work_dir / "datasets" / "train"),
                "val_dir": str(work_dir / "datasets" / "val"),
                "init_from_dir": init,
                "classes": ["a", "b"],
                "output_dir": str(self.run_dir),
                "task": self.task,
            }
        )


@pytest.fixture
def no_trainer_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's kinds fetch nothing and start no torchrun; the agent's environment has a
    secret the ranks must not see and no GPUs of its own."""
    FakeRunInputs.made = []
    monkeypatch.setattr(trainer, "RunInputs", FakeRunInputs)
    monkeypatch.setattr(trainer, "RankGroup", StartedGroup)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TORCHYARD_TOKEN", "a-worker-secret")
