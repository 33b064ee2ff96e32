"""The Slurm driver (:mod:`service.engines.slurm`) against what a real Slurm printed.

Every command the driver runs is answered from ``recorded/`` (see its README: Slurm 22.05 on
the tests' private cluster, a few lines crafted from Slurm's formats and marked so): the
``Slurm`` of :mod:`tests.support.recorded_slurm` answers by the exact command line and keeps each command and environment it
was given, so the tests check both what the driver asks Slurm and what it makes of the
answers. Nothing runs a Slurm command; only ``start()``'s look for the commands on ``PATH``
is real (empty files stand in). The driver on the real cluster: ``tests/e2e/test_slurm.py``.
"""

from __future__ import annotations

import logging
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.engines.base import (
    Ending,
    EngineJobState,
    EngineNotAnswering,
    EngineUnavailable,
    NodeSeen,
    Phase,
    SubmitRefused,
)
from service.engines.slurm import SlurmDriver
from service.engines.slurm_cli import COMMANDS
from tests.support.recorded_slurm import (
    CLEAN_ENV,
    NOT_ANSWERING,
    RECORDED,
    SINFO,
    SQUEUE,
    USER_FILTER,
    RecordedSlurm,
    Reply,
    gpu_cluster,
    recorded,
    recorded_cluster,
    request,
    settings_for,
    show_job,
    show_partition,
    squeue_named,
    started,
)
from torchyard.contract.states import NodeStatus


@pytest.fixture(autouse=True)
def slurm_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Slurm's commands on PATH for ``start()`` to find (never run: the answers are recorded)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in COMMANDS:
        (bin_dir / name).write_text("#!/bin/sh\nexit 99\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


# --- start --------------------------------------------------------------------------------


def test_start_names_the_missing_commands(tmp_path: Path, slurm_on_path: Path) -> None:
    (slurm_on_path / "sinfo").unlink()
    (slurm_on_path / "scancel").unlink()
    slurm = recorded_cluster(tmp_path)
    with pytest.raises(EngineUnavailable, match=r"Slurm's sinfo, scancel not found on PATH"):
        SlurmDriver(settings_for(tmp_path), slurm=slurm).start()
    assert slurm.calls == []


def test_start_with_no_slurm_at_all_names_every_command(tmp_path: Path, slurm_on_path: Path) -> None:
    shutil.rmtree(slurm_on_path)
    with pytest.raises(EngineUnavailable) as raised:
        SlurmDriver(settings_for(tmp_path), slurm=recorded_cluster(tmp_path)).start()
    assert all(name in str(raised.value) for name in COMMANDS)


def test_start_checks_the_partitions_and_reads_their_grace(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    slurm = recorded_cluster(settings.slurm_outputs)
    driver = SlurmDriver(settings, slurm=slurm)
    driver.start()
    assert driver.partitions == ["low", "high"]
    assert slurm.argvs == [list(SINFO), list(show_partition("low")), list(show_partition("high"))]
    assert settings.slurm_outputs.is_dir()


def test_an_unknown_partition_is_one_line_naming_the_known_ones(tmp_path: Path) -> None:
    driver = SlurmDriver(settings_for(tmp_path, slurm_partitions="low,gpu"), slurm=recorded_cluster(tmp_path))
    with pytest.raises(EngineUnavailable) as raised:
        driver.start()
    message = str(raised.value)
    assert message == (
        "TORCHYARD_SLURM_PARTITIONS: no partition gpu in this Slurm cluster (it has high, low)"
    )
    assert "\n" not in message


def test_without_partitions_the_default_one_is_used(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path, slurm_partitions="")
    assert driver.partitions == ["low"]  # sinfo marks the default "low*"
    driver.inventory()
    assert slurm.argvs == [[*SINFO, "-p", "low"]]


def test_a_cluster_without_a_default_partition_is_refused(tmp_path: Path) -> None:
    slurm = recorded_cluster(tmp_path)
    # What sinfo prints when no partition is Default=YES (none is marked with '*').
    slurm.answer(("sinfo", "-h", "-o", "%P"), "low\nhigh\n")
    driver = SlurmDriver(settings_for(tmp_path, slurm_partitions=""), slurm=slurm)
    with pytest.raises(EngineUnavailable, match="the Slurm cluster has no default partition"):
        driver.start()


def test_a_slurm_that_does_not_answer_at_start_is_unavailable(tmp_path: Path) -> None:
    slurm = recorded_cluster(tmp_path)
    slurm.answer(SINFO, Reply(code=1, stderr="sinfo: error: " + NOT_ANSWERING))
    with pytest.raises(
        EngineUnavailable, match=r"Slurm does not answer: .*Unable to contact slurm controller"
    ):
        SlurmDriver(settings_for(tmp_path), slurm=slurm).start()


def test_a_grace_longer_than_the_partitions_grace_time_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="service.engines.slurm"):
        started(tmp_path, slurm_partitions="low", preempt_grace_s=45)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "TORCHYARD_PREEMPT_GRACE_S is 45 s but partition low gives preempted jobs 30 s "
        "(GraceTime): checkpoints may be cut short"
    ]


@pytest.mark.parametrize("grace_s", [10, 30])
def test_a_grace_within_the_partitions_grace_time_is_not_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, grace_s: float
) -> None:
    with caplog.at_level(logging.WARNING, logger="service.engines.slurm"):
        started(tmp_path, slurm_partitions="low", preempt_grace_s=grace_s)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


# --- inventory ----------------------------------------------------------------------------


def test_inventory_of_the_idle_cluster(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    nodes = driver.inventory()
    assert slurm.argvs == [[*SINFO, "-p", "low,high"]]
    assert nodes == [
        NodeSeen(
            name=f"n{i}",
            address=f"10.77.29.{i + 1}",
            units=2,  # gres gpu:2
            accelerator="gpu",
            status=NodeStatus.READY,
            state="idle",
            why="",
            info={"partitions": ["low", "high"], "gpus": 2, "cpus": 4},
        )
        for i in (1, 2)
    ]


# Recorded sinfo outputs: each node's status and Slurm's word for its state.
NODE_STATES = [
    ("sinfo-mix-alloc.txt", {"n1": (NodeStatus.READY, "mix"), "n2": (NodeStatus.READY, "alloc")}),
    ("sinfo-draining.txt", {"n1": (NodeStatus.DRAINED, "drng"), "n2": (NodeStatus.READY, "idle")}),
    ("sinfo-drained.txt", {"n1": (NodeStatus.DRAINED, "drain"), "n2": (NodeStatus.READY, "idle")}),
    ("sinfo-down-completing.txt", {"n1": (NodeStatus.READY, "comp"), "n2": (NodeStatus.LOST, "down")}),
    ("sinfo-not-responding.txt", {"n1": (NodeStatus.READY, "idle"), "n2": (NodeStatus.LOST, "idle*")}),
    ("sinfo-down-not-responding.txt", {"n1": (NodeStatus.READY, "idle"), "n2": (NodeStatus.LOST, "down*")}),
]


@pytest.mark.parametrize(("sinfo", "expected"), NODE_STATES, ids=[s for s, _ in NODE_STATES])
def test_inventory_node_states(
    tmp_path: Path, sinfo: str, expected: dict[str, tuple[NodeStatus, str]]
) -> None:
    settings = settings_for(tmp_path)
    driver, _ = started(tmp_path, recorded_cluster(settings.slurm_outputs, sinfo=sinfo))
    nodes = driver.inventory()
    assert {n.name: (n.status, n.state) for n in nodes} == expected
    for node in nodes:
        assert sorted(node.info["partitions"]) == ["high", "low"]  # one row per partition, merged
        if node.status is NodeStatus.READY:
            assert node.why == ""
        else:
            assert node.why == f"node {node.name} is {node.state} in Slurm"


def test_inventory_of_a_gpu_cluster_counts_gpus_and_asks_for_them(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path, gpu_cluster(), slurm_partitions="gpu")
    nodes = driver.inventory()
    assert [(n.name, n.units, n.accelerator, n.status, n.address) for n in nodes] == [
        ("gpu01", 4, "gpu", NodeStatus.READY, "10.0.0.11"),
        ("gpu02", 4, "gpu", NodeStatus.READY, "10.0.0.12"),
    ]
    assert nodes[0].info == {"partitions": ["gpu", "preempt"], "gpus": 4, "cpus": 64}
    slurm.answer(squeue_named("torchyard-j1-1"), "")
    slurm.answer(("sbatch",), "41\n")
    assert driver.submit(request(process_count_per_node=3)) == "41"
    argv = slurm.sbatch_calls()[0][0]
    assert "--gres=gpu:3" in argv and not any(a.startswith("--cpus-per-task") for a in argv)


def test_inventory_of_cpu_only_nodes_counts_cpus_and_asks_for_them(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    slurm = recorded_cluster(settings.slurm_outputs, sinfo="crafted/sinfo-cpu-only.txt")
    driver, _ = started(tmp_path, slurm)
    nodes = driver.inventory()
    assert [(n.name, n.units, n.accelerator) for n in nodes] == [("n1", 4, "cpu"), ("n2", 4, "cpu")]
    assert nodes[0].info == {"partitions": ["low", "high"], "gpus": 0, "cpus": 4}
    slurm.answer(squeue_named("torchyard-j1-1"), "")
    slurm.answer(("sbatch",), "42\n")
    driver.submit(request(process_count_per_node=3))
    argv = slurm.sbatch_calls()[0][0]
    assert "--cpus-per-task=3" in argv and not any(a.startswith("--gres") for a in argv)


def test_inventory_when_sinfo_fails_is_not_answering(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    slurm.answer((*SINFO, "-p", "low,high"), Reply(code=1, stderr="sinfo: error: " + NOT_ANSWERING))
    with pytest.raises(EngineNotAnswering, match="Unable to contact slurm controller"):
        driver.inventory()
    slurm.answer((*SINFO, "-p", "low,high"), Reply(code=124, stderr="no answer within 30 s"))
    with pytest.raises(EngineNotAnswering, match="no answer within 30 s"):
        driver.inventory()


# --- submit -------------------------------------------------------------------------------


def test_the_recorded_submission_and_its_polls(tmp_path: Path) -> None:
    """The attempt SlurmDriver submitted to the real cluster: the same sbatch command and
    batch script (which that Slurm accepted), then what squeue and scontrol said of it."""
    driver, slurm = started(tmp_path, slurm_partitions="low", slurm_launcher="/bin/echo launch")
    outputs = driver.settings.slurm_outputs
    driver.inventory()
    slurm.answer(squeue_named("torchyard-j1-1"), "")
    slurm.answer(("sbatch",), "1\n")
    assert driver.submit(request(max_runtime_s=90)) == "1"
    argv, _ = slurm.sbatch_calls()[0]
    assert argv == shlex.split(recorded("driver-sbatch-argv.txt", outputs))
    assert (outputs / "torchyard-j1-1.sh").read_text() == recorded("driver-job-script.txt")

    slurm.answer(SQUEUE, recorded("squeue-submitted.txt"))
    assert driver.poll(["1"]) == {
        "1": EngineJobState(id="1", phase=Phase.PENDING, state="PENDING", reason="None")
    }
    slurm.answer(SQUEUE, recorded("squeue-started.txt"))
    assert driver.poll(["1"])["1"] == EngineJobState(
        id="1", phase=Phase.RUNNING, state="RUNNING", reason="None"
    )
    slurm.answer(SQUEUE, recorded("squeue-ended.txt"))
    slurm.answer(show_job("1"), recorded("job-driver-completed.txt", outputs))
    shutil.copy(RECORDED / "output" / "torchyard-j1-1-1.out", outputs)
    assert driver.poll(["1"])["1"] == EngineJobState(
        id="1",
        phase=Phase.ENDED,
        state="COMPLETED",
        reason="None",
        ending=Ending.COMPLETED,
        summary="Slurm job 1 ended COMPLETED (exit code 0:0, reason None)",
        output_tail="launch --api http://api:8000 --attempt a1\nlaunch --api http://api:8000 --attempt a1",
    )


def test_the_sbatch_command_line_script_and_environment(tmp_path: Path) -> None:
    driver, slurm = started(
        tmp_path,
        slurm=recorded_cluster(tmp_path / "data" / "slurm", sinfo="crafted/sinfo-cpu-only.txt"),
        preempt_grace_s=12.5,
        slurm_sbatch_args="--account=ml --qos='high prio'",
        slurm_work_dir="/scratch/ty run",
    )
    outputs = driver.settings.slurm_outputs
    driver.inventory()
    slurm.answer(squeue_named("torchyard-job7-3"), "")
    slurm.answer(("sbatch",), "77\n")
    job = request(job_id="job7", attempt_id="att-9", attempt_number=3, node_count=2, process_count_per_node=2)
    assert driver.submit(job) == "77"
    assert slurm.argvs[-2] == list(squeue_named("torchyard-job7-3"))  # asked before sbatch
    argv, env = slurm.sbatch_calls()[0]
    script = outputs / "torchyard-job7-3.sh"
    assert argv == [
        "sbatch", "--parsable",
        "-J", "torchyard-job7-3",
        "-p", "low,high",
        "-N", "2",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        "--no-requeue",
        "--signal=USR1@13",  # ceil(12.5)
        f"--output={outputs}/torchyard-job7-3-%j.out",
        f"--chdir={outputs}",
        "--account=ml", "--qos=high prio",
        str(script),
    ]  # fmt: skip
    assert script.read_text().splitlines()[-1] == (
        "exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 torchyard launch --api http://api:8000 "
        "--attempt att-9 --work-dir '/scratch/ty run'"
    )
    assert env == {
        **CLEAN_ENV,
        "TORCHYARD_LAUNCH_TOKEN": "launch-secret",
        "TORCHYARD_PREEMPT_GRACE_S": "12.5",
    }


@pytest.mark.parametrize(
    ("max_runtime_s", "time"),
    [(None, None), (0, None), (1, "--time=1"), (60, "--time=1"), (61, "--time=2"), (3600.5, "--time=61")],
)
def test_the_time_limit_is_max_runtime_in_whole_minutes(
    tmp_path: Path, max_runtime_s: float | None, time: str | None
) -> None:
    driver, _ = started(tmp_path)
    driver.inventory()
    argv, _ = driver.sbatch_command(request(max_runtime_s=max_runtime_s))
    assert [a for a in argv if a.startswith("--time")] == ([time] if time else [])


def test_sbatch_gets_none_of_the_apis_own_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHYARD_ADMIN_TOKEN", "admin-secret")
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", "postgresql://u:p@db/torchyard")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/other.conf")
    monkeypatch.setenv("HOME", "/home/api")
    settings = settings_for(tmp_path)
    slurm = recorded_cluster(settings.slurm_outputs)
    slurm.env = RecordedSlurm().env  # made from this (API's) environment, as in production
    driver, _ = started(tmp_path, slurm)
    driver.inventory()
    slurm.answer(squeue_named("torchyard-j1-1"), "")
    slurm.answer(("sbatch",), "5\n")
    driver.submit(request())
    kept = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "SLURM_CONF"}
    for _, env in slurm.calls:
        assert "admin-secret" not in env.values() and "aws-secret" not in env.values()
        assert set(env) <= kept | {"TORCHYARD_LAUNCH_TOKEN", "TORCHYARD_PREEMPT_GRACE_S"}
    _, env = slurm.sbatch_calls()[0]
    assert env["SLURM_CONF"] == "/etc/slurm/other.conf" and env["HOME"] == "/home/api"
    assert env["TORCHYARD_LAUNCH_TOKEN"] == "launch-secret" and env["TORCHYARD_PREEMPT_GRACE_S"] == "30"
    # Only sbatch gets the launch token.
    assert all("TORCHYARD_LAUNCH_TOKEN" not in env for argv, env in slurm.calls if argv[0] != "sbatch")


@pytest.mark.parametrize("answer", ["squeue-name-own.txt", "squeue-name-unfiltered.txt"])
def test_a_job_of_the_same_name_by_the_apis_user_is_adopted(tmp_path: Path, answer: str) -> None:
    driver, slurm = started(tmp_path)
    driver.inventory()
    slurm.answer(squeue_named("torchyard-jobk-1"), recorded(answer))
    assert driver.submit(request(job_id="jobk")) == "6"  # not 8: nobody's job of that name
    assert slurm.sbatch_calls() == []


def test_another_users_job_of_the_same_name_is_not_adopted(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    driver.inventory()
    slurm.answer(squeue_named("torchyard-j2-1"), recorded("squeue-name-other-user.txt"))
    slurm.answer(("sbatch",), "3\n")
    assert driver.submit(request(job_id="j2")) == "3"
    assert len(slurm.sbatch_calls()) == 1


@pytest.mark.parametrize(
    ("stderr", "words"),
    [
        ("sbatch-invalid-partition.stderr", "Invalid partition name specified"),
        ("sbatch-unsatisfiable.stderr", "Requested node configuration is not available"),
    ],
)
def test_sbatchs_refusal_carries_slurms_words(tmp_path: Path, stderr: str, words: str) -> None:
    driver, slurm = started(tmp_path)
    driver.inventory()
    slurm.answer(squeue_named("torchyard-j1-1"), "")
    slurm.answer(("sbatch",), Reply(code=1, stderr=recorded(stderr)))
    with pytest.raises(SubmitRefused) as raised:
        driver.submit(request())
    assert str(raised.value).startswith("sbatch refused the job: ")
    assert recorded(stderr).strip() in str(raised.value) and words in str(raised.value)


@pytest.mark.parametrize(
    "reply",
    [
        Reply(code=124, stderr="no answer within 30 s"),
        Reply(code=127, stderr="sbatch: command not found"),
        # sbatch exits 1 for this as for a refusal (the message is Slurm 22.05's).
        Reply(
            code=1,
            stderr="sbatch: error: Batch job submission failed: Unable to contact slurm controller "
            "(connect failure)\n",
        ),
    ],
    ids=["timeout", "missing", "controller-down"],
)
def test_sbatch_not_answering_is_tried_again(tmp_path: Path, reply: Reply) -> None:
    driver, slurm = started(tmp_path)
    driver.inventory()
    slurm.answer(squeue_named("torchyard-j1-1"), "")
    slurm.answer(("sbatch",), reply)
    with pytest.raises(EngineNotAnswering, match=re.escape(reply.stderr.strip())):
        driver.submit(request())


@pytest.mark.parametrize(
    "reply",
    [Reply(code=124, stderr="no answer within 30 s"), Reply(code=1, stderr=NOT_ANSWERING)],
    ids=["timeout", "controller-down"],
)
def test_a_failed_look_for_an_earlier_submission_is_not_a_refusal(tmp_path: Path, reply: Reply) -> None:
    """squeue failing before sbatch is Slurm not answering, never sbatch refusing the job."""
    driver, slurm = started(tmp_path)
    driver.inventory()
    slurm.answer(squeue_named("torchyard-j1-1"), reply)
    with pytest.raises(EngineNotAnswering):
        driver.submit(request())
    assert slurm.sbatch_calls() == []


# --- poll ---------------------------------------------------------------------------------


def test_poll_of_no_jobs_asks_nothing(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    assert driver.poll([]) == {}
    assert slurm.calls == []


def test_pending_and_running_jobs_are_read_from_one_squeue(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    states = driver.poll(["10", "11", "2", "9"])
    assert slurm.argvs == [list(SQUEUE)]  # scontrol only for ended jobs
    assert states == {
        "10": EngineJobState(id="10", phase=Phase.PENDING, state="PENDING", reason="Resources"),
        "11": EngineJobState(id="11", phase=Phase.PENDING, state="PENDING", reason="Priority"),
        "2": EngineJobState(id="2", phase=Phase.PENDING, state="PENDING", reason="PartitionNodeLimit"),
        "9": EngineJobState(id="9", phase=Phase.RUNNING, state="RUNNING", reason="None"),
    }


def test_a_completing_job_is_still_running(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    slurm.answer(SQUEUE, recorded("squeue-node-fail.txt"))  # n2 just set down under job 1
    states = driver.poll(["1", "2"])
    assert states["1"] == EngineJobState(id="1", phase=Phase.RUNNING, state="COMPLETING", reason="NodeDown")
    assert states["2"].phase is Phase.RUNNING and states["2"].state == "COMPLETING"
    assert slurm.argvs == [list(SQUEUE)]


@dataclass(frozen=True)
class Ended:
    id: str
    squeue: str
    scontrol: str
    state: str
    ending: Ending
    exit_code: str
    reason: str
    output: str | None  # the job's output file (recorded/output/), if it has one


ENDED = [
    Ended("4", "squeue.txt", "job-completed.txt", "COMPLETED", Ending.COMPLETED, "0:0", "None", "torchyard-jobc-1-4.out"),
    Ended("5", "squeue.txt", "job-failed.txt", "FAILED", Ending.FAILED, "3:0", "NonZeroExitCode", "torchyard-jobf-1-5.out"),
    Ended("6", "squeue.txt", "job-cancelled.txt", "CANCELLED", Ending.CANCELLED, "0:15", "None", "torchyard-jobk-1-6.out"),
    Ended("7", "squeue.txt", "job-preempted.txt", "PREEMPTED", Ending.PREEMPTED, "0:15", "None", "torchyard-jobl-1-7.out"),
    Ended("3", "squeue.txt", "job-timeout.txt", "TIMEOUT", Ending.PREEMPTED, "0:15", "TimeLimit", "torchyard-jobt-1-3.out"),
    Ended("3", "squeue-node-failed.txt", "job-node-fail.txt", "NODE_FAIL", Ending.NODE_LOST, "0:15", "NodeDown", "torchyard-jobn-1-3.out"),
    Ended("21", "crafted/squeue-out-of-memory.txt", "crafted/job-out-of-memory.txt", "OUT_OF_MEMORY", Ending.FAILED, "0:125", "OutOfMemory", None),
]  # fmt: skip


@pytest.mark.parametrize("case", ENDED, ids=[e.state for e in ENDED])
def test_an_ended_job_says_how_it_ended(tmp_path: Path, case: Ended) -> None:
    driver, slurm = started(tmp_path)
    outputs = driver.settings.slurm_outputs
    slurm.answer(SQUEUE, recorded(case.squeue))
    slurm.answer(show_job(case.id), recorded(case.scontrol, outputs))
    if case.output is not None:
        shutil.copy(RECORDED / "output" / case.output, outputs)
    state = driver.poll([case.id])[case.id]
    assert slurm.argvs == [list(SQUEUE), list(show_job(case.id))]
    assert (state.id, state.phase, state.state, state.ending, state.reason) == (
        case.id, Phase.ENDED, case.state, case.ending, case.reason,
    )  # fmt: skip
    assert state.summary == (
        f"Slurm job {case.id} ended {case.state} (exit code {case.exit_code}, reason {case.reason})"
    )
    if case.output is not None:
        assert state.output_tail == (RECORDED / "output" / case.output).read_text().strip()
    else:
        name = recorded(case.scontrol).split("JobName=")[1].split()[0]
        assert state.output_tail.startswith(f"(no output at {outputs / f'{name}-{case.id}.out'}")


def test_the_output_tail_is_the_last_4000_bytes(tmp_path: Path) -> None:
    driver, _ = started(tmp_path)
    outputs = driver.settings.slurm_outputs
    failure = (RECORDED / "output" / "torchyard-jobf-1-5.out").read_bytes()
    text = b"".join(b"epoch %05d loss 0.5\n" % i for i in range(1000)) + failure
    (outputs / "torchyard-jobf-1-5.out").write_bytes(text)
    tail = driver.poll(["5"])["5"].output_tail
    assert tail == text[-4000:].decode().strip()
    assert tail.endswith("oops")


def test_a_job_slurm_forgot_ended_forgotten(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    slurm.answer(show_job("99999"), Reply(code=1, stderr=recorded("job-unknown.stderr")))
    state = driver.poll(["99999", "9"])
    assert state["9"].phase is Phase.RUNNING
    forgotten = state["99999"]
    assert (forgotten.phase, forgotten.state, forgotten.ending) == (Phase.ENDED, "FORGOTTEN", Ending.FAILED)
    assert "Slurm job 99999 ended FORGOTTEN" in forgotten.summary
    assert forgotten.output_tail.startswith("(no output at ")


def test_poll_when_squeue_fails_is_not_answering(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    slurm.answer(SQUEUE, Reply(code=1, stderr=NOT_ANSWERING))
    with pytest.raises(EngineNotAnswering, match="Unable to contact slurm controller"):
        driver.poll(["9"])
    slurm.answer(SQUEUE, recorded("squeue.txt"))
    slurm.answer(show_job("5"), Reply(code=124, stderr="no answer within 30 s"))
    with pytest.raises(EngineNotAnswering, match="no answer within 30 s"):
        driver.poll(["5"])


# --- cancel -------------------------------------------------------------------------------


def test_cancel_is_scancel_limited_to_the_apis_user(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    driver.cancel("6")
    assert slurm.argvs == [["scancel", *USER_FILTER, "6"]]


def test_cancelling_a_job_slurm_no_longer_has_is_no_error(tmp_path: Path) -> None:
    driver, slurm = started(tmp_path)
    driver.cancel("99999")  # scancel exits 1: "Invalid job id specified"
    assert slurm.argvs == [["scancel", *USER_FILTER, "99999"]]


def test_a_teams_account_goes_to_sbatch(tmp_path: Path) -> None:
    driver, _ = started(tmp_path)
    driver.inventory()
    argv, _ = driver.sbatch_command(request(account="vision-lab"))
    assert "--account=vision-lab" in argv
    argv, _ = driver.sbatch_command(request())
    assert not [a for a in argv if a.startswith("--account")], "no team account: Slurm's default"
