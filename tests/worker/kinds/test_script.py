"""Script placements on the agent (worker/agent/kinds/script.py): what prepare asks for, the
processes it launches (the placement's GPUs, the command and environment each process gets),
and the end: which node keeps its outputs, when a failed upload fails the placement, what a
stop keeps. No process starts and nothing is uploaded: both are recorded instead."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from tests.worker.kinds.conftest import FakeHost, script_placement
from torchyard.contract.failures import FailureReport
from torchyard.contract.jobspec import JobKind
from worker.agent.kinds import script
from worker.agent.kinds.script import ScriptRun
from worker.agent.script_launch import ScriptLaunch
from worker.agent.script_outputs import LIGHTNING_LOGS
from worker.agent.script_run import ScriptGroup


def _launch_of(host: FakeHost, *, launch: str = "per_process") -> ScriptLaunch:
    """What prepare_script would describe for the host's placement (the job's own MLflow
    server: no endpoint of the agent's is started)."""
    work = host.placement
    return ScriptLaunch(
        run_dir=host.run_dir,
        node_name=host.ctx.node_name,
        node_rank=host.node_rank,
        node_count=work.node_count,
        nproc=host.units,
        master_addr=work.master_addr,
        master_port=work.master_port,
        cpus=host.ctx.cpus_for(host.units),
        command=("python", "main.py", "--rank", "$RANK", "--out", "$TORCHYARD_OUTPUT_DIR", "$HOME"),
        launch=launch,
        variables={"MLFLOW_TRACKING_URI": "http://mlflow.example:5000", "SEED": "3"},
        own_dir=host.agent_dir,
    )


class Prepared:
    """prepare_script, recorded."""

    def __init__(self, launch: ScriptLaunch) -> None:
        self.launch = launch
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> ScriptLaunch:
        self.calls.append((args, kwargs))
        return self.launch


class StartedScripts(ScriptGroup):
    """The script processes with their start recorded instead of made."""

    fail_start = False

    def start(self, output: IO[str]) -> int:
        if self.fail_start:
            raise OSError("no such interpreter")
        output.write("the script would start here\n")
        return 5151


def _prepared(host: FakeHost, monkeypatch: pytest.MonkeyPatch, **launch: Any) -> tuple[ScriptRun, Prepared]:
    prepared = Prepared(_launch_of(host, **launch))
    monkeypatch.setattr(script, "prepare_script", prepared)
    monkeypatch.setattr(script, "ScriptGroup", StartedScripts)
    run = ScriptRun(host)
    run.prepare()
    return run, prepared


# --- prepare and launch ------------------------------------------------------------------------------


def test_prepare_describes_the_launch_in_the_placements_folders(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = make_host(script_placement())
    run, prepared = _prepared(host, monkeypatch)
    assert prepared.calls == [
        ((host.ctx, host.placement, host.run_dir, host.stop_event, host.log), {"agent_dir": host.agent_dir})
    ]
    assert run.launched is prepared.launch
    assert ScriptRun.kind is JobKind.SCRIPT
    assert not ScriptRun.hands_back_when_draining


def test_the_processes_get_the_placements_gpus_ranks_and_paths(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite's test processes set one
    monkeypatch.setenv("HOME", "/home/agent")
    host = make_host(script_placement(node_rank=1, node_count=2, nproc=2), gpu_ids=(2, 5))
    run, prepared = _prepared(host, monkeypatch)
    agent_log = host.agent_dir / "agent.log"
    group, reporter = run.launch(agent_log)

    assert isinstance(group, StartedScripts)
    assert host.group is group is run.group
    assert run.launched == dataclasses.replace(prepared.launch, gpu_ids=(2, 5))
    outputs = str(host.run_dir / "outputs")
    # Node rank 1 of 2 nodes, 2 processes each: global ranks 2 and 3. Only the command's
    # launch variables and the agent's paths are expanded; "python" is the worker's.
    assert [p.argv for p in group.processes] == [
        [sys.executable, "main.py", "--rank", "2", "--out", outputs, "$HOME"],
        [sys.executable, "main.py", "--rank", "3", "--out", outputs, "$HOME"],
    ]
    first, second = (p.env for p in group.processes)
    assert (first["RANK"], first["LOCAL_RANK"], first["WORLD_SIZE"], first["NODE_RANK"]) == (
        "2",
        "0",
        "4",
        "1",
    )
    assert (second["RANK"], second["LOCAL_RANK"]) == ("3", "1")
    assert first["MASTER_ADDR"] == "10.0.0.7" and first["MASTER_PORT"] == "29533"
    assert first["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert first["OMP_NUM_THREADS"] == "2"  # 4 CPUs (2 of 4 units of 8) over 2 processes
    assert first["SEED"] == "3"
    assert first["TORCHYARD_OUTPUT_DIR"] == outputs
    assert first["TORCHYARD_METRICS_FILE"] == str(host.run_dir / "metrics" / "rank-2.jsonl")
    assert agent_log.read_text() == "the script would start here\n"
    assert reporter == "reporter"
    [shipped] = host.reporters
    assert shipped["agent_log"] == agent_log
    assert shipped["log_sources"] == group.log_files
    assert shipped["metrics"] == group.metric_files
    assert shipped["tracking_source"] == group.tracking_source


def test_per_node_runs_the_command_once_with_the_nodes_variables(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = make_host(script_placement(node_rank=1, node_count=2, nproc=3))
    run, _ = _prepared(host, monkeypatch, launch="per_node")
    group, _ = run.launch(host.agent_dir / "agent.log")
    [process] = group.processes
    assert process.argv[2:4] == ["--rank", "$RANK"]  # no RANK per node
    env = process.env
    assert (env["NNODES"], env["NPROC_PER_NODE"], env["NODE_RANK"]) == ("2", "3", "1")
    assert "RANK" not in env and "LOCAL_RANK" not in env


def test_a_launch_that_fails_to_start_closes_the_tracking_and_raises(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = make_host(script_placement())
    run, _ = _prepared(host, monkeypatch)
    closed: list[bool] = []
    monkeypatch.setattr(StartedScripts, "fail_start", True)
    monkeypatch.setattr(StartedScripts, "close_tracking", lambda self: closed.append(True))
    with pytest.raises(OSError, match="no such interpreter"):
        run.launch(host.agent_dir / "agent.log")
    assert closed == [True]
    assert host.reporters == []


# --- the end -------------------------------------------------------------------------------------------


class EndedScripts:
    """The ended processes of a placement, as the outcome reads them."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.kept: list[tuple[str, ...]] = []
        self.tracking_closed = 0

    def name_unkept_files(self, kept: tuple[str, ...] = ()) -> list[str]:
        self.kept.append(tuple(kept))
        return []

    def failure(self, exit_code: int | None) -> FailureReport:
        return FailureReport(code="RankFailedError", message=f"rank 0 exited with code {exit_code}", rank=0)

    def working_copies(self) -> list[Path]:
        return [self.run_dir / "work" / "rank-0", self.run_dir / "work" / "rank-1"]

    def close_tracking(self) -> None:
        self.tracking_closed += 1


class Uploads:
    """upload_outputs_of, recorded; raises ``error`` when set."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.error: Exception | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        return "sha"


def _ended(
    make_host: Any, monkeypatch: pytest.MonkeyPatch, **placement: Any
) -> tuple[FakeHost, ScriptRun, EndedScripts, Uploads]:
    host = make_host(script_placement(**placement))
    run = ScriptRun(host)
    run.launched = _launch_of(host)
    group = EndedScripts(host.run_dir)
    run.group = group  # type: ignore[assignment]
    uploads = Uploads()
    monkeypatch.setattr(script, "upload_outputs_of", uploads)
    return host, run, group, uploads


def test_node_rank_0_keeps_its_outputs_logs_and_lightning_logs_on_success(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, run, group, uploads = _ended(make_host, monkeypatch)
    assert run.outcome(0, host.agent_dir / "agent.log") == ("succeeded", None)
    assert group.kept == [(LIGHTNING_LOGS,)]
    [(args, kwargs)] = uploads.calls
    assert args[:3] == (host.session, host.run_dir / "outputs", host.run_dir / "logs")
    assert kwargs == {
        "outage_deadline": host.report.deadline,
        "archive_dir": host.agent_dir,
        "lightning_logs": [
            host.run_dir / "work" / "rank-0" / LIGHTNING_LOGS,
            host.run_dir / "work" / "rank-1" / LIGHTNING_LOGS,
        ],
    }


@pytest.mark.parametrize(("outputs", "uploaded"), [("node0", False), ("all", True)])
def test_another_node_keeps_its_outputs_only_with_outputs_all(
    make_host: Any, monkeypatch: pytest.MonkeyPatch, outputs: str, uploaded: bool
) -> None:
    host, run, group, uploads = _ended(make_host, monkeypatch, node_rank=1, node_count=2, outputs=outputs)
    assert run.outcome(0, host.agent_dir / "agent.log") == ("succeeded", None)
    assert bool(uploads.calls) is uploaded
    assert group.kept == [(LIGHTNING_LOGS,) if uploaded else ()]


def test_a_failed_script_keeps_its_outputs_and_reports_its_failure(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, run, _, uploads = _ended(make_host, monkeypatch)
    state, failure = run.outcome(3, host.agent_dir / "agent.log")
    assert state == "failed"
    assert failure == FailureReport(code="RankFailedError", message="rank 0 exited with code 3", rank=0)
    assert len(uploads.calls) == 1


def test_a_success_whose_outputs_cannot_be_uploaded_fails(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, run, _, uploads = _ended(make_host, monkeypatch)
    uploads.error = OSError("disk full")
    assert run.outcome(0, host.agent_dir / "agent.log") == (
        "failed",
        FailureReport(
            code="RankFailedError",
            message="the outputs of node n1 could not be uploaded: disk full",
            node="n1",
        ),
    )


def test_a_failure_whose_outputs_cannot_be_uploaded_keeps_its_own_failure(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, run, _, uploads = _ended(make_host, monkeypatch)
    uploads.error = OSError("disk full")
    state, failure = run.outcome(2, host.agent_dir / "agent.log")
    assert state == "failed" and failure is not None
    assert failure.message == "rank 0 exited with code 2"


@pytest.mark.parametrize(("stop_kind", "uploaded"), [("cancelled", False), ("attempt_ended", True)])
def test_a_stopped_script_keeps_its_outputs_only_when_its_attempt_ended(
    make_host: Any, monkeypatch: pytest.MonkeyPatch, stop_kind: str, uploaded: bool
) -> None:
    """A node stopped because its attempt ended (another node's outputs "all" failure, node
    rank 0's success) still keeps what it wrote; a cancelled one does not."""
    host, run, _, uploads = _ended(make_host, monkeypatch)
    host.stop_event.set()
    host.stop_kind = stop_kind
    assert run.outcome(-15, host.agent_dir / "agent.log") == ("stopped", None)
    assert bool(uploads.calls) is uploaded


def test_close_ends_the_tracking_once_the_processes_ended(
    make_host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, run, group, _ = _ended(make_host, monkeypatch)
    run.close()
    assert group.tracking_closed == 1
    ScriptRun(host).close()  # nothing launched: nothing to close
