"""Training placements on the agent (worker/agent/kinds/train.py and the trainer runs it shares
with evaluations, worker/agent/kinds/trainer.py): what prepare asks for, the torchrun launch
it builds (command, environment, sandbox), the guards it starts, and how it judges the end.
No process starts: torchrun's start is replaced by one that records it."""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.worker.kinds.conftest import FakeHost, FakeRunInputs, StartedGroup, train_placement
from torchyard.contract.failures import FailureReport
from torchyard.contract.jobfile import JOB_FILE, TrainerTask
from torchyard.contract.jobspec import JobKind
from worker.agent import sandbox
from worker.agent.kinds.train import TrainRun
from worker.agent.watchdog import PREEMPTED_FILE, HangWatchdog

pytestmark = pytest.mark.usefixtures("no_trainer_processes")


def _launched(host: FakeHost) -> tuple[TrainRun, StartedGroup]:
    run = TrainRun(host)
    run.prepare()
    group, reporter = run.launch(host.agent_dir / "agent.log")
    assert isinstance(group, StartedGroup) and reporter == "reporter"
    return run, group


# --- prepare ---------------------------------------------------------------------------------------


def test_prepare_fetches_the_training_inputs_for_the_trainer_in_training_mode(make_host: Any) -> None:
    host = make_host(train_placement())
    run = TrainRun(host)
    run.prepare()
    [made] = FakeRunInputs.made
    assert made == {
        "ctx": host.ctx,
        "work": host.placement,
        "run_dir": host.run_dir,
        "stop": host.stop_event,
        "log": host.log,
        "session": host.session,
        "task": TrainerTask.TRAIN,
    }
    assert run.job is not None and run.job.task is TrainerTask.TRAIN
    assert TrainRun.kind is JobKind.TRAIN
    assert TrainRun.hands_back_when_draining  # claimed while draining: handed back untouched


# --- launch ----------------------------------------------------------------------------------------


def test_torchrun_is_launched_for_this_node_of_the_attempt(make_host: Any) -> None:
    host = make_host(train_placement(node_rank=1, node_count=3, nproc=2))
    _, group = _launched(host)
    spec = group.spec

    assert host.group is group
    assert (spec.run_dir, spec.node_name, spec.node_rank, spec.node_count) == (host.run_dir, "n1", 1, 3)
    assert (spec.nproc, spec.master_addr, spec.master_port) == (2, "10.0.0.7", 29533)
    assert spec.cpus == 4  # 8 CPUs over 4 units: 2 units get 4
    assert spec.gpu_ids == () and spec.box is None and not spec.shielded
    assert group.command == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "3",
        "--nproc-per-node",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.7",
        "--master-port",
        "29533",
        "--log-dir",
        str(host.run_dir / "torchrun-logs"),
        "--redirects",
        "3",
        "-m",
        "worker.trainer",
        "--config",
        str(host.run_dir / JOB_FILE),
    ]
    assert (host.agent_dir / "agent.log").read_text() == "torchrun would start here\n"
    [reporter] = host.reporters
    assert reporter["agent_log"] == host.agent_dir / "agent.log"
    assert reporter["log_sources"]() == []  # no rank has written a log yet


def test_the_ranks_environment_is_the_placements_share_of_the_node(make_host: Any) -> None:
    host = make_host(train_placement(nproc=2), ctx={"socket_ifname": "eth7"})
    _, group = _launched(host)
    env = group.env
    assert env["OMP_NUM_THREADS"] == "2"  # 4 CPUs over 2 ranks
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["TORCHYARD_DEVICE"] == "cpu"
    assert env["TORCHYARD_NODE_NAME"] == "n1"
    assert env["GLOO_SOCKET_IFNAME"] == "eth7"
    assert "TORCHYARD_TOKEN" not in env


def test_the_placements_gpus_are_the_ranks_devices(make_host: Any) -> None:
    host = make_host(train_placement(nproc=2), gpu_ids=(1, 3))
    _, group = _launched(host)
    assert group.spec.gpu_ids == (1, 3)
    assert group.env["CUDA_VISIBLE_DEVICES"] == "1,3" and group.env["TORCHYARD_DEVICE"] == "cuda"


def test_a_shielded_agent_launches_shielded_ranks(make_host: Any) -> None:
    host = make_host(train_placement(), ctx={"shielded": True})
    _, group = _launched(host)
    assert group.spec.shielded
    assert group.env["PET_SIGNALS_TO_HANDLE"] == "SIGINT,SIGHUP,SIGQUIT"


def test_under_bwrap_the_ranks_see_their_run_and_read_only_inputs(
    make_host: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    placement = train_placement().model_copy(update={"init_from_job": "earlier"})
    host = make_host(placement, gpu_ids=(0,), ctx={"sandbox": sandbox.BWRAP})
    _, group = _launched(host)
    box = group.spec.box
    assert box is not None
    work = host.ctx.work_dir
    assert box.writable == host.run_dir
    assert list(box.hidden) == [work]
    assert box.read_only == [
        work / "datasets" / "train",
        work / "datasets" / "val",
        work / "models" / "init",
        tmp_path / "torch" / "hub",
    ]
    assert box.gpus


def _boxed(make_host: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Any, Any]:
    """A training placement launched under bwrap without an initial model: the host, its launch."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    host = make_host(train_placement(), ctx={"sandbox": sandbox.BWRAP})
    _, group = _launched(host)
    return host, group


def test_without_an_initial_model_the_sandbox_shows_the_datasets_and_the_hub(
    make_host: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, group = _boxed(make_host, monkeypatch, tmp_path)
    assert group.spec.box is not None
    assert [p.name for p in group.spec.box.read_only] == ["train", "val", "hub"]
    assert not group.spec.box.gpus


# --- guards ----------------------------------------------------------------------------------------


def test_node_rank_0_uploads_checkpoints_and_a_hang_timeout_starts_the_watchdog(make_host: Any) -> None:
    host = make_host(train_placement(hang_timeout_s=90, nproc=2))
    _, group = _launched(host)
    [uploader] = host.session.uploaders
    assert host.uploader is uploader and uploader.started and uploader.run_dir == host.run_dir
    assert isinstance(host.watchdog, HangWatchdog)
    assert host.watchdog.timeout_s == 90.0
    assert host.watchdog.root_pid == 4242
    assert host.watchdog.spec is group.spec
    assert host.watchdog.ranks == [0, 1]


def test_another_node_uploads_no_checkpoints_and_no_timeout_means_no_watchdog(make_host: Any) -> None:
    host = make_host(train_placement(node_rank=1, node_count=2, hang_timeout_s=None))
    _launched(host)
    assert host.session.uploaders == [] and host.uploader is None
    assert host.watchdog is None


def test_a_zero_hang_timeout_starts_no_watchdog(make_host: Any) -> None:
    host = make_host(train_placement(hang_timeout_s=0))
    _launched(host)
    assert host.watchdog is None


# --- outcome ---------------------------------------------------------------------------------------


def test_success_on_node_rank_0_is_the_model_directorys_upload(make_host: Any) -> None:
    host = make_host(train_placement())
    run, _ = _launched(host)
    assert run.outcome(0, host.agent_dir / "agent.log") == ("succeeded", None)
    assert host.report.model_uploads == [host.run_dir]


def test_a_model_that_cannot_be_uploaded_fails_the_placement(make_host: Any) -> None:
    host = make_host(train_placement())
    host.report.model_failure = FailureReport(
        code="InvalidModelDirectoryError", message="no model", node="n1"
    )
    run, _ = _launched(host)
    assert run.outcome(0, host.agent_dir / "agent.log") == ("failed", host.report.model_failure)


def test_success_on_another_node_uploads_nothing(make_host: Any) -> None:
    host = make_host(train_placement(node_rank=1, node_count=2))
    run, _ = _launched(host)
    assert run.outcome(0, host.agent_dir / "agent.log") == ("succeeded", None)
    assert host.report.model_uploads == []


def test_a_stop_wins_over_everything_else(make_host: Any) -> None:
    host = make_host(train_placement())
    run, _ = _launched(host)
    host.stop_event.set()
    host.hang = FailureReport(code="HangError", message="hung")
    host.preempt_event.set()
    assert run.outcome(0, host.agent_dir / "agent.log") == ("stopped", None)
    assert host.report.model_uploads == []


def test_a_hang_is_the_failure(make_host: Any) -> None:
    host = make_host(train_placement())
    run, _ = _launched(host)
    host.hang = FailureReport(code="HangError", message="no step for 90 s", rank=1, node="n1")
    assert run.outcome(-15, host.agent_dir / "agent.log") == ("failed", host.hang)


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_preemption_is_preempted_whether_or_not_its_checkpoint_was_finished(
    make_host: Any, checkpointed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    host = make_host(train_placement())
    run, _ = _launched(host)
    host.preempt_event.set()
    if checkpointed:
        (host.run_dir / PREEMPTED_FILE).write_text("{}")
    with caplog.at_level("WARNING", logger=host.log.name):
        assert run.outcome(0, host.agent_dir / "agent.log") == ("preempted", None)
    warned = "the ranks did not finish their preemption checkpoint" in caplog.text
    assert warned is not checkpointed
    assert host.report.model_uploads == []


def _failure_file(run_dir: Path, rank: int, **fields: Any) -> None:
    record = {
        "code": "TrainingDivergedError",
        "message": f"rank {rank}: the loss is nan",
        "rank": rank,
        "local_rank": rank % 2,
        "node": "n1",
        "traceback": "Traceback ...",
        "time": 1.0,
    } | fields
    (run_dir / f"failure-rank-{rank}.json").write_text(json.dumps(record))


def test_a_failed_rank_reports_its_own_failure(make_host: Any, caplog: pytest.LogCaptureFixture) -> None:
    host = make_host(train_placement(nproc=2))
    run, _ = _launched(host)
    _failure_file(host.run_dir, 1)
    with caplog.at_level(logging.ERROR):
        state, failure = run.outcome(1, host.agent_dir / "agent.log")
    # The rank printed its message in the job's log: the agent's line does not repeat it.
    assert "failed: TrainingDivergedError (rank 1 on n1): its error is in the rank's log above" in caplog.text
    assert "the loss is nan" not in caplog.text
    assert state == "failed"
    assert failure is not None
    assert (failure.code, failure.message, failure.rank, failure.node) == (
        "TrainingDivergedError",
        "rank 1: the loss is nan",
        1,
        "n1",
    )
    assert not failure.secondary


def test_ranks_that_left_no_failure_file_fail_with_torchruns_exit(make_host: Any) -> None:
    host = make_host(train_placement())
    run, _ = _launched(host)
    state, failure = run.outcome(3, host.agent_dir / "agent.log")
    assert state == "failed" and failure is not None
    assert failure.code == "RankFailedError"
    assert failure.node == "n1" and failure.rank is None
    assert failure.message == "the ranks on node n1 ended: torchrun exited with code 3"


class RecordingEvent(threading.Event):
    """A stop event whose wait is recorded and ends with the stop set (the API stopped the
    placement meanwhile) or not."""

    def __init__(self, stops: bool) -> None:
        super().__init__()
        self.stops = stops
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if self.stops:
            self.set()
        return self.is_set()


@pytest.mark.parametrize(("stopped_meanwhile", "state"), [(True, "stopped"), (False, "failed")])
def test_an_echo_of_a_failure_elsewhere_waits_for_the_root_cause(
    make_host: Any, stopped_meanwhile: bool, state: str
) -> None:
    """A secondary failure (a broken collective) on a multi-node job waits a lease timeout and
    two heartbeats for the node where it started to report it (the API then stops this one)."""
    event = RecordingEvent(stops=stopped_meanwhile)
    host = make_host(
        train_placement(node_count=2),
        stop_event=event,
        ctx={"lease_timeout_s": 7.0, "heartbeat_interval_s": 1.5},
    )
    run, _ = _launched(host)
    _failure_file(host.run_dir, 0, code="RankFailedError", message="a peer vanished", secondary=True)
    result_state, failure = run.outcome(1, host.agent_dir / "agent.log")
    assert event.waits == [10.0]
    assert result_state == state
    if state == "failed":
        assert failure is not None
        assert failure.code == "CommunicationError" and failure.secondary
    else:
        assert failure is None


def test_an_echo_on_a_one_node_job_does_not_wait(make_host: Any) -> None:
    event = RecordingEvent(stops=True)
    host = make_host(train_placement(node_count=1), stop_event=event)
    run, _ = _launched(host)
    _failure_file(host.run_dir, 0, code="RankFailedError", secondary=True)
    state, failure = run.outcome(1, host.agent_dir / "agent.log")
    assert event.waits == []
    assert state == "failed" and failure is not None and failure.code == "CommunicationError"


def test_the_sandbox_shows_the_nodes_image_cache_writable(
    make_host: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host, group = _boxed(make_host, monkeypatch, tmp_path)
    images = host.ctx.work_dir / "image-cache"
    assert list(group.spec.box.binds) == [(images, str(images))]
    assert images.is_dir()
