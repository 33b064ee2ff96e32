"""Starting a node's ranks without training: the torchrun command and environment, failure
selection, and stopping a process tree whose members live in sessions of their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchyard.contract.protocol import ClaimedPlacement
from worker.agent.agent import Agent, AgentOptions, UnitPool
from worker.agent.marked_processes import MARKER_VAR, marked_pids
from worker.agent.node import NodeResources, interface_for
from worker.agent.placement import PlacementRun
from worker.agent.rank_failures import collect_failure, first_failure, rank_log_files
from worker.agent.rank_group import LaunchSpec, RankGroup, rank_env, torchrun_command
from worker.agent.runs import prune_runs, shed_results

# Stands in for torchrun: starts two "ranks" in sessions of their own (as torch elastic
# does) that ignore SIGTERM, then waits.
FAKE_TORCHRUN = textwrap.dedent(
    """
    import subprocess, sys, time
    rank = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    for _ in range(2):
        subprocess.Popen([sys.executable, "-c", rank], start_new_session=True)
    print("ranks started", flush=True)
    time.sleep(600)
    """
)


def _spec(tmp_path: Path, **kw: object) -> LaunchSpec:
    values: dict[str, object] = {
        "run_dir": tmp_path,
        "node_name": "node-a",
        "node_rank": 1,
        "node_count": 2,
        "nproc": 2,
        "master_addr": "10.1.2.3",
        "master_port": 29555,
        "cpus": 8,
    }
    values.update(kw)
    return LaunchSpec(**values)  # type: ignore[arg-type]


def test_torchrun_command_follows_the_trainer_contract(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert torchrun_command(spec) == [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1",
        "--master-addr", "10.1.2.3", "--master-port", "29555",
        "--log-dir", str(tmp_path / "torchrun-logs"), "--redirects", "3",
        "-m", "worker.trainer", "--config", str(tmp_path / "job.json"),
    ]  # fmt: skip


def test_rank_environment_on_cpu_and_cuda(tmp_path: Path) -> None:
    base = {"PATH": "/usr/bin", "RANK": "7", "MASTER_ADDR": "stale", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    cpu = rank_env(_spec(tmp_path, socket_ifname="eth1"), base, "node-a/x")
    assert cpu[MARKER_VAR] == "node-a/x" and cpu["TORCHYARD_NODE_NAME"] == "node-a"
    assert cpu["OMP_NUM_THREADS"] == "4"  # 8 cpus // 2 processes
    assert cpu["TORCHYARD_DEVICE"] == "cpu" and cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert cpu["GLOO_SOCKET_IFNAME"] == "eth1"
    assert "RANK" not in cpu and "MASTER_ADDR" not in cpu and cpu["PATH"] == "/usr/bin"
    cuda = rank_env(_spec(tmp_path, gpu_ids=(2, 3), socket_ifname="ib0", cpus=3), base, "m")
    assert cuda["CUDA_VISIBLE_DEVICES"] == "2,3" and cuda["TORCHYARD_DEVICE"] == "cuda"
    assert cuda["NCCL_SOCKET_IFNAME"] == "ib0" and cuda["OMP_NUM_THREADS"] == "1"


def test_rank_logs_map_to_global_ranks(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    for local in ("0", "1"):
        d = tmp_path / "torchrun-logs" / "none_abc" / "attempt_0" / local
        d.mkdir(parents=True)
        (d / "stdout.log").write_text("out\n")
        (d / "stderr.log").write_text("err\n")
        (d / "error.json").write_text("{}")
    streams = sorted((s, p.name) for s, p in rank_log_files(spec))
    assert streams == [
        ("rank-2", "stderr.log"),
        ("rank-2", "stdout.log"),
        ("rank-3", "stderr.log"),
        ("rank-3", "stdout.log"),
    ]


def test_the_root_cause_is_the_earliest_primary_failure(tmp_path: Path) -> None:
    records = [
        {"code": "RankFailedError", "message": "gloo broke", "rank": 0, "time": 1.0, "secondary": True},
        {"code": "TrainingDivergedError", "message": "nan", "rank": 3, "time": 3.0, "secondary": False},
        {"code": "RankFailedError", "message": "boom", "rank": 2, "time": 2.0, "secondary": False},
    ]
    assert first_failure(records) == records[2]
    for i, record in enumerate(records):
        (tmp_path / f"failure-rank-{i}.json").write_text(json.dumps(record))
    failure = collect_failure(_spec(tmp_path), 1, tmp_path / "agent.log")
    assert failure.message == "boom" and failure.rank == 2 and failure.node == "node-a"


def test_without_failure_files_torchruns_root_cause_names_the_rank(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    log_dir = tmp_path / "torchrun-logs" / "none_x" / "attempt_0" / "1"
    log_dir.mkdir(parents=True)
    (log_dir / "stderr.log").write_text("loading...\nSegmentation fault\n")
    placement_log = tmp_path / "agent.log"
    placement_log.write_text(
        "Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : h\n"
        "  rank      : 3 (local_rank: 1)\n  exitcode  : -11 (pid: 4242)\n"
    )
    failure = collect_failure(spec, 1, placement_log)
    assert failure.code == "RankFailedError" and failure.rank == 3
    assert failure.message == "rank 3 (local rank 1) on node node-a was killed by SIGSEGV"
    assert "Segmentation fault" in failure.traceback


def test_stop_kills_every_process_of_the_run_even_in_other_sessions(tmp_path: Path) -> None:
    group = RankGroup(_spec(tmp_path))
    group.command = [sys.executable, "-c", FAKE_TORCHRUN]
    with open(tmp_path / "agent.log", "w") as out:
        group.start(out)
    deadline = time.monotonic() + 30
    while len(group.alive_pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = group.alive_pids()
    assert len(pids) == 3  # the stand-in and its two ranks
    started = time.monotonic()
    group.stop(grace=1.0)
    assert time.monotonic() - started < 8
    assert group.alive_pids() == []
    assert marked_pids(group.marker) == []


def test_torchrun_dies_with_its_agent(tmp_path: Path) -> None:
    # A pretend agent starts the stand-in through the guard, then is SIGKILLed.
    work_dir = tmp_path / "work"
    run_dir = work_dir / "runs" / "r1"
    run_dir.mkdir(parents=True)
    agent_code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from worker.agent.rank_group import LaunchSpec, RankGroup
        spec = LaunchSpec(run_dir=Path({str(run_dir)!r}), node_name="node-z", node_rank=0, node_count=1,
                          nproc=1, master_addr="127.0.0.1", master_port=29500, cpus=1)
        group = RankGroup(spec)
        group.command = [sys.executable, "-c", {FAKE_TORCHRUN!r}]
        with open(spec.run_dir / "agent.log", "w") as out:
            group.start(out)
        print(group.marker, flush=True)
        time.sleep(600)
        """
    )
    agent = subprocess.Popen([sys.executable, "-c", agent_code], stdout=subprocess.PIPE, text=True)
    assert agent.stdout is not None
    marker = agent.stdout.readline().strip()
    deadline = time.monotonic() + 30
    while len(marked_pids(marker)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(marked_pids(marker)) == 3
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    # torchrun (here the stand-in) is gone at once; the ranks it started are left to the
    # real torchrun's SIGTERM handling, which a stand-in lacks: the next agent kills them.
    deadline = time.monotonic() + 10
    while len(marked_pids(marker)) > 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(marked_pids(marker)) == 2
    from worker.agent.marked_processes import kill_leftovers

    # Another agent of the same node name but with its own work directory (a second
    # service on this machine) leaves them alone; the same agent restarted kills them.
    assert kill_leftovers("node-z", tmp_path / "other-work") == []
    assert len(kill_leftovers("node-z", work_dir)) == 2
    deadline = time.monotonic() + 10
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_pids(marker) == []


def test_unit_pool_and_loopback_interface() -> None:
    pool = UnitPool([0, 1, 2, 3])
    a = pool.take(2)
    b = pool.take(2)
    assert set(a) | set(b) == {0, 1, 2, 3} and not set(a) & set(b)
    pool.give(a)
    assert pool.take(1) == (0,)
    assert interface_for("127.0.0.1") == "lo"


def _run_dir(runs: Path, name: str, age_s: float) -> Path:
    path = runs / name
    (path / "checkpoints").mkdir(parents=True)
    (path / "checkpoints" / "last.pt").write_bytes(b"x" * 1024)
    (path / "agent.log").write_text("done\n")
    stamp = time.time() - age_s
    for p in (path / "checkpoints" / "last.pt", path / "checkpoints", path / "agent.log", path):
        os.utime(p, (stamp, stamp))
    return path


def test_prune_keeps_the_newest_finished_runs_and_never_a_running_one(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    oldest = _run_dir(runs, "j1-a1-n", 400)
    running = _run_dir(runs, "j2-a1-n", 300)  # old, but its placement is still running
    older = _run_dir(runs, "j3-a1-n", 200)
    newest = _run_dir(runs, "j4-a1-n", 100)
    (runs / "stray-file").write_text("not a run")

    removed = prune_runs(runs, keep=2, active=[running])
    assert sorted(removed) == [oldest]
    assert running.exists() and older.exists() and newest.exists()
    assert (runs / "stray-file").exists()

    assert prune_runs(runs, keep=0, active=[running]) == [newest, older]
    assert running.exists()
    assert prune_runs(tmp_path / "missing", keep=0, active=[]) == []
    with pytest.raises(ValueError):
        prune_runs(runs, keep=-1, active=[])


def test_shed_results_removes_what_the_api_stores_and_keeps_the_logs(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "j1-a1-n"
    for rel, size in {
        "model/model.safetensors": 5000,
        "model/config.json": 10,
        "checkpoint.pt": 3000,
        "outputs/result.bin": 2000,
        "work/node-0/train.py": 100,
        "node-0.tar.gz": 700,
        "logs/rank-0.log": 50,
        "agent.log": 40,
        "job.json": 30,
    }.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(b"x" * size)
    cache = tmp_path / "cache"
    (cache / "digits").mkdir(parents=True)
    (run / "inputs").mkdir()
    (run / "inputs" / "train").symlink_to(cache / "digits")  # the node's cached dataset

    assert shed_results(run) == 5000 + 10 + 3000 + 2000 + 100 + 700
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [
        "agent.log",
        "job.json",
        "logs",
        "logs/rank-0.log",
    ]
    assert (cache / "digits").is_dir()  # a link is removed, never what it points to
    assert shed_results(run) == 0
    assert shed_results(tmp_path / "missing") == 0


def test_a_finished_placement_prunes_old_runs_but_not_its_peers(tmp_path: Path) -> None:
    """The agent's release of a placement: units back, then old run directories removed."""
    agent = Agent(
        AgentOptions(api_url="http://127.0.0.1:9", token="t", name="n", work_dir=tmp_path, keep_runs=1),
        NodeResources(units=2, cpus=2, gpu_ids=(), accelerator="cpu"),
    )

    def placement(job: str) -> PlacementRun:
        # Only what the run directory's name and the unit count need (no validation).
        work = ClaimedPlacement.model_construct(
            job_id=job, lease_token=f"lease-{job}", node_rank=0, process_count_per_node=1, attempt_number=1
        )
        run = PlacementRun(agent.ctx, work, agent.units.take(1), gpu_ids=())
        agent.runs[run.lease_token] = run
        return run

    older = _run_dir(agent.ctx.runs_dir, "old-a1-n", 500)
    peer, finished = placement("peer"), placement("done")
    _run_dir(agent.ctx.runs_dir, peer.run_dir.name, 1000)  # the oldest, but still running
    _run_dir(agent.ctx.runs_dir, finished.run_dir.name, 10)

    agent._release(finished)
    assert list(agent.runs) == ["lease-peer"]
    assert agent.units.take(1) == (finished.unit_ids[0],)
    assert not older.exists()
    assert peer.run_dir.exists() and finished.run_dir.exists()
    agent.api.close()


def _placement_log(tmp_path: Path, exitcode: int) -> Path:
    path = tmp_path / "agent.log"
    path.write_text(
        "Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : h\n"
        f"  rank      : 1 (local_rank: 1)\n  exitcode  : {exitcode} (pid: 4242)\n"
    )
    return path


def test_failures_are_classified_for_the_restart_policy(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    # A rank killed from outside (SIGKILL: the OOM killer, an operator) is RankKilledError...
    killed = collect_failure(spec, 1, _placement_log(tmp_path, -9))
    assert killed.code == "RankKilledError" and killed.rank == 1
    assert "was killed by SIGKILL" in killed.message
    # ... even when its peer left a record of the collective that broke under it.
    echo = {"code": "RankFailedError", "message": "gloo: Connection closed by peer", "rank": 0, "time": 1.0}
    (tmp_path / "failure-rank-0.json").write_text(json.dumps({**echo, "secondary": True}))
    assert collect_failure(spec, 1, _placement_log(tmp_path, -9)).code == "RankKilledError"
    # ... also when torchrun names that peer as its root cause (dated first, to the second).
    (tmp_path / "agent.log").write_text(
        "Failures:\n[1]:\n  time      : x\n  host      : h\n  rank      : 1 (local_rank: 1)\n"
        "  exitcode  : -9 (pid: 4243)  (SIGKILL)\n  error_file: <N/A>\n"
        "Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : h\n"
        "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 4242)\n"
    )
    peer_first = collect_failure(spec, 1, tmp_path / "agent.log")
    assert peer_first.code == "RankKilledError" and peer_first.rank == 1
    # A broken collective with no killed rank on this node: CommunicationError (retryable).
    broken = collect_failure(spec, 1, _placement_log(tmp_path, 1))
    assert broken.code == "CommunicationError" and broken.rank == 0
    # An ordinary non-zero exit stays RankFailedError.
    (tmp_path / "failure-rank-0.json").write_text(json.dumps({**echo, "message": "boom", "secondary": False}))
    assert collect_failure(spec, 1, _placement_log(tmp_path, 1)).code == "RankFailedError"
    (tmp_path / "failure-rank-0.json").unlink()
    # A rendezvous that never formed (torchrun's own error, no rank ever ran): CommunicationError.
    log = tmp_path / "agent.log"
    log.write_text("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: timed out\n")
    assert collect_failure(spec, 1, log).code == "CommunicationError"


def test_a_placement_gets_its_units_share_of_the_nodes_cpus(tmp_path: Path) -> None:
    """Threads per rank follow the placement's units, not the whole node: two 1-unit jobs on a
    2-slot, 2-core node run one thread each instead of two each on the same cores."""
    agent = Agent(
        AgentOptions(api_url="http://127.0.0.1:9", token="t", name="n", work_dir=tmp_path),
        NodeResources(units=2, cpus=2, gpu_ids=(), accelerator="cpu"),
    )
    work = ClaimedPlacement.model_construct(
        job_id="j", lease_token="lease-j", node_rank=0, node_count=1, process_count_per_node=1,
        attempt_number=1, master_addr="127.0.0.1", master_port=29500,
    )  # fmt: skip
    run = PlacementRun(agent.ctx, work, agent.units.take(1), gpu_ids=())
    assert agent.ctx.cpus_for(1) == 1 and agent.ctx.cpus_for(2) == 2
    share = agent.ctx.cpus_for(run.units)
    assert rank_env(_spec(tmp_path, cpus=share, nproc=1), {}, "m")["OMP_NUM_THREADS"] == "1"
    big = Agent(
        AgentOptions(api_url="http://127.0.0.1:9", token="t", name="b", work_dir=tmp_path / "b"),
        NodeResources(units=4, cpus=16, gpu_ids=(), accelerator="cpu"),
    )
    assert [big.ctx.cpus_for(u) for u in (1, 2, 4)] == [4, 8, 16]
    agent.api.close()
    big.api.close()
