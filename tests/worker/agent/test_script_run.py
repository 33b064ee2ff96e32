"""The pieces of script jobs that need no service: ``.torchyardignore`` rules, what a
code upload holds, ``$NAME`` expansion, a process's environment, ``torchyard.run`` and
the agent's reading of the metrics files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchyard import run
from torchyard.apiclient.code import IgnoreRules, code_files
from worker.agent.run_files import RunFileReader
from worker.agent.script_launch import ScriptLaunch, expand, script_env
from worker.agent.script_run import ScriptGroup


@pytest.mark.parametrize(
    ("pattern", "path", "is_dir", "ignored"),
    [
        ("*.pt", "outputs/model.pt", False, True),
        ("*.pt", "model.ptx", False, False),
        ("data/", "data", True, True),
        ("data/", "data", False, False),  # a file named data is not the folder
        ("/build", "build", True, True),
        ("/build", "src/build", True, False),  # anchored to the top
        ("docs/*.md", "docs/a.md", False, True),
        ("docs/*.md", "docs/sub/a.md", False, False),
        ("**/cache", "a/b/cache", True, True),
        ("logs/**", "logs/x/y.txt", False, True),
        ("secret?.txt", "secret1.txt", False, True),
        ("[ab].py", "b.py", False, True),
        ("[!ab].py", "b.py", False, False),
    ],
)
def test_ignore_rules_follow_gitignore(pattern: str, path: str, is_dir: bool, ignored: bool) -> None:
    assert IgnoreRules([pattern]).ignored(path, is_dir) is ignored


def test_negation_and_comments() -> None:
    rules = IgnoreRules(["# results", "*.csv", "!keep.csv", "", r"\#literal"])
    assert rules.ignored("a.csv", False) and not rules.ignored("keep.csv", False)
    assert rules.ignored("#literal", False)


def test_code_files_apply_the_ignore_file_and_leave_out_hidden_files_and_links(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "data").mkdir()
    (src / "train.py").write_text("x")
    (src / "pkg" / "m.py").write_text("x")
    (src / "data" / "big.bin").write_text("x")
    (src / "model.pt").write_text("x")
    (src / ".env").write_text("SECRET=1")
    (src / ".torchyardignore").write_text("data/\n*.pt\n")
    (src / "link.py").symlink_to(src / "train.py")
    files, skipped = code_files(src)
    assert files == ["pkg/m.py", "train.py"]
    assert skipped == ["link.py"]


def test_expand_replaces_known_variables_only() -> None:
    v = {"RANK": "3", "WORLD_SIZE": "8"}
    assert expand("--rank=$RANK/${WORLD_SIZE}", v) == "--rank=3/8"
    assert expand("$HOME $$RANK ${NOPE}", v) == "$HOME $RANK ${NOPE}"


def _launch(tmp_path: Path, **kw: object) -> ScriptLaunch:
    values: dict[str, object] = {
        "run_dir": tmp_path / "work" / "runs" / "r1",
        "node_name": "n1",
        "node_rank": 1,
        "node_count": 2,
        "nproc": 2,
        "master_addr": "10.0.0.1",
        "master_port": 29400,
        "cpus": 4,
        "command": ("python", "train.py", "--rank", "$RANK"),
        "variables": {"K": "V"},
        "inputs": {"data": tmp_path / "in"},
    }
    values.update(kw)
    return ScriptLaunch(**values)  # type: ignore[arg-type]


def test_process_environment_has_the_launch_variables_and_no_secrets(tmp_path: Path) -> None:
    base = {
        "PATH": "/usr/bin",
        "TORCHYARD_TOKEN": "secret",
        "TORCHYARD_DATA_DIR": "/srv/data",
        "TORCHYARD_DATABASE_URL": "postgresql://x",
        "RANK": "99",
        "HOME": "/root",
    }
    launch = _launch(tmp_path)
    env = script_env(launch, base, "marker", 1, 3)
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "NODE_RANK": "1", "WORLD_SIZE": "4",
        "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    }  # fmt: skip
    assert (
        "TORCHYARD_TOKEN" not in env
        and "TORCHYARD_DATA_DIR" not in env
        and "TORCHYARD_DATABASE_URL" not in env
    )
    assert env["K"] == "V" and env["HOME"] == "/root"
    assert env["TORCHYARD_INPUT_DATA"] == str(tmp_path / "in")
    assert env["TORCHYARD_METRICS_FILE"].endswith("rank-3.jsonl")
    per_node = script_env(_launch(tmp_path, launch="per_node"), base, "marker", None, 2)
    assert (per_node["NNODES"], per_node["NPROC_PER_NODE"], per_node["NODE_RANK"]) == ("2", "2", "1")
    assert "RANK" not in per_node and "WORLD_SIZE" not in per_node
    group = ScriptGroup(_launch(tmp_path), env=base)
    assert [p.argv[-1] for p in group.processes] == ["2", "3"]
    assert group.processes[0].argv[0] == launch.python  # "python" is the worker's interpreter


def test_command_expands_the_launch_variables_and_paths_only(tmp_path: Path) -> None:
    """``$NAME`` in the command names the launch variables and the agent's TORCHYARD_* paths;
    the rest of the environment (the worker's HOME, PATH, the job's own variables) stays as
    written."""
    base = {"PATH": "/usr/bin", "HOME": "/root", "USER": "worker"}
    command = ("python", "t.py", "$RANK", "${LOCAL_RANK}", "$TORCHYARD_INPUT_DATA",
               "${TORCHYARD_OUTPUT_DIR}/m.pt", "$HOME", "${PATH}", "$K", "$USER", "$$RANK")  # fmt: skip
    launch = _launch(tmp_path, command=command)
    first = ScriptGroup(launch, env=base).processes[0]
    assert first.argv[2:] == ["2", "0", str(tmp_path / "in"), f"{launch.outputs_dir}/m.pt",
                              "$HOME", "${PATH}", "$K", "$USER", "$RANK"]  # fmt: skip
    assert first.env["HOME"] == "/root" and first.env["K"] == "V"  # still in the environment
    per_node = _launch(
        tmp_path, launch="per_node", command=("torchrun", "$NNODES", "$RANK", "$TORCHYARD_LOG_DIR")
    )
    assert ScriptGroup(per_node, env=base).processes[0].argv == [
        "torchrun",
        "2",
        "$RANK",
        str(launch.logs_dir),
    ]


def test_log_metric_appends_lines_and_counts_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.jsonl"
    monkeypatch.setenv("TORCHYARD_METRICS_FILE", str(path))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setattr(run, "_steps", {})
    run.log_metric("loss", 0.5)
    run.log_metric("loss", 0.25)
    run.log_metric("acc", 1, step=7, epoch=1)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["name"], r["value"], r["step"], r["epoch"], r["rank"]) for r in lines] == [
        ("loss", 0.5, 0, 0, 2),
        ("loss", 0.25, 1, 0, 2),
        ("acc", 1.0, 7, 1, 2),
    ]
    for bad in (lambda: run.log_metric("no spaces", 1), lambda: run.log_metric("x", float("nan"))):
        with pytest.raises(ValueError):
            bad()
    monkeypatch.delenv("TORCHYARD_METRICS_FILE")
    run.log_metric("loss", 1.0)  # outside a job: nothing written, no error
    assert len(path.read_text().splitlines()) == 3


def test_output_and_log_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHYARD_OUTPUT_DIR", str(tmp_path / "o"))
    monkeypatch.delenv("TORCHYARD_LOG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert run.output_dir() == tmp_path / "o" and (tmp_path / "o").is_dir()
    assert run.log_dir() == Path("logs") and (tmp_path / "logs").is_dir()


def test_the_agent_reads_script_metrics_with_steps_and_skips_bad_lines(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    f = metrics / "rank-0.jsonl"
    f.write_text(
        '{"name": "a", "value": 1}\n{"name": "a", "value": 2}\nnot json\n{"name": "bad name", "value": 1}\n'
        '{"name": "b", "value": 3, "step": 5, "epoch": 2, "rank": 1}\n{"name": "a", "val'
    )
    agent_log = tmp_path / "agent.log"
    agent_log.write_text("")
    reader = RunFileReader("j", tmp_path, lambda: [], agent_log, "n", lambda: sorted(metrics.glob("*.jsonl")))
    batch = reader.collect(final=False)
    assert [(m["name"], m["value"], m["step"], m["epoch"], m["rank"]) for m in batch.metrics] == [
        ("a", 1.0, 0, 0, 0),
        ("a", 2.0, 1, 0, 0),
        ("b", 3.0, 5, 2, 1),
    ]
    with open(f, "a") as fh:
        fh.write('ue": 4}\n')  # the partial line is read once complete
    assert [(m["name"], m["value"], m["step"]) for m in reader.collect(final=False).metrics] == [
        ("a", 4.0, 2)
    ]
    assert os.path.getsize(f) > 0


def test_logs_folder_files_become_bounded_text_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.agent.script_run as script_run

    launch = _launch(tmp_path)  # node rank 1
    group = ScriptGroup(launch)
    logs = launch.logs_dir
    (logs / "tb").mkdir(parents=True)
    (logs / "train.log").write_text("epoch 1\n")
    (logs / "tb" / "events.txt").write_text("x")
    (logs / "empty.log").write_text("")  # nothing yet: looked at again later
    (logs / "model.bin").write_bytes(b"PK\x00\x03")  # binary: left out
    (logs / "bad name.txt").write_text("space")  # no stream name for it: left out
    (logs / ".hidden").write_text("h")
    (logs / "link.log").symlink_to(logs / "train.log")  # not a regular file: left out
    assert sorted(group.log_dir_files()) == [
        ("file-1/tb/events.txt", logs / "tb" / "events.txt"),
        ("file-1/train.log", logs / "train.log"),
    ]
    (logs / "empty.log").write_text("now text")
    assert ("file-1/empty.log", logs / "empty.log") in group.log_dir_files()
    # The rank logs come first, then the folder's files.
    assert [s for s, _ in group.log_files()][:2] == ["rank-2", "rank-3"]
    monkeypatch.setattr(script_run, "MAX_LOG_DIR_FILES", 4)
    for i in range(3):
        (logs / f"more-{i}.log").write_text("m")
    assert len(group.log_dir_files()) == 4  # at most MAX_LOG_DIR_FILES, the rest stays on the node


def test_a_logs_file_stream_is_cut_at_its_bound_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.agent.run_files as run_files

    monkeypatch.setattr(run_files, "MAX_LOG_FILE_BYTES", 10)
    big = tmp_path / "big.log"
    big.write_text("0123456789abcdef")
    rank_log = tmp_path / "rank.log"
    rank_log.write_text("0123456789abcdef")  # a rank's own output has no such bound
    agent_log = tmp_path / "agent.log"
    agent_log.write_text("")
    sources = [("file-0/big.log", big), ("rank-0", rank_log)]
    reader = RunFileReader("j", tmp_path, lambda: sources, agent_log, "n")
    shipped: dict[str, str] = {}
    for _ in range(3):
        for chunk in reader.collect(final=True).logs:
            shipped[chunk["stream"]] = shipped.get(chunk["stream"], "") + chunk["data"]
    assert shipped["rank-0"] == "0123456789abcdef"
    assert shipped["file-0/big.log"].startswith(
        "0123456789\n[torchyard agent: this file is longer than 10 bytes"
    )
    assert shipped["file-0/big.log"].count("[torchyard agent") == 1  # said once


def test_tensorboard_scalars_become_metric_lines_as_the_files_grow(tmp_path: Path) -> None:
    """torch's SummaryWriter writes the files; tensorboard's own loader reads them."""
    pytest.importorskip("tensorboard")
    import logging

    from torch.utils.tensorboard import SummaryWriter

    from worker.agent.tensorboard_scalars import METRICS_FILE_NAME, ScalarTailer

    work, shared, metrics = tmp_path / "work" / "rank-1", tmp_path / "logs", tmp_path / "metrics"
    for folder in (work, shared, metrics):
        folder.mkdir(parents=True)
    job_log = logging.getLogger("test.tensorboard")
    tailer = ScalarTailer([(work, 1, False), (shared, 0, True)], metrics, job_log)
    writer = SummaryWriter(log_dir=str(work / "runs" / "exp"))
    writer.add_scalar("Loss/train", 0.5, 0)
    writer.add_scalar("loss bad?", 1.0, 0)  # no metric name for it: said once, skipped
    writer.flush()
    assert tailer.poll() == 1
    writer.add_scalar("Loss/train", 0.25, 1)
    writer.add_scalar("acc", float("nan"), 1)  # not finite: not a metric point
    writer.close()
    other = SummaryWriter(log_dir=str(shared / "tb"))
    other.add_scalar("shared", 3.0, 7)
    other.close()
    assert tailer.poll() == 2
    assert tailer.poll() == 0  # nothing new, nothing twice
    lines = [json.loads(line) for line in (metrics / METRICS_FILE_NAME).read_text().splitlines()]
    assert [(p["name"], p["value"], p["step"], p["rank"]) for p in lines] == [
        ("Loss/train", 0.5, 0, 1),
        ("Loss/train", 0.25, 1, 1),
        ("shared", 3.0, 7, 0),
    ]


def test_outputs_archive_holds_the_logs_folder_within_its_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tarfile

    import worker.agent.script_outputs as script_outputs

    outputs, logs = tmp_path / "outputs", tmp_path / "logs"
    (logs / "lightning_logs" / "version_0").mkdir(parents=True)
    outputs.mkdir()
    (outputs / "model.pt").write_bytes(b"weights")
    (logs / "lightning_logs" / "version_0" / "last.ckpt").write_bytes(b"\x00ckpt")
    (logs / "big.log").write_bytes(b"x" * 50)
    for i in range(3):
        (logs / f"n{i}.log").write_text(str(i))
    (logs / "link.log").symlink_to(logs / "n0.log")
    monkeypatch.setattr(script_outputs, "MAX_ARCHIVED_LOG_FILE_BYTES", 40)
    monkeypatch.setattr(script_outputs, "MAX_ARCHIVED_LOG_FILES", 3)
    notes: list[str] = []
    _sha, _size, count = script_outputs.pack_outputs(outputs, tmp_path / "o.tar.gz", logs, notes.append)
    with tarfile.open(tmp_path / "o.tar.gz") as tf:
        names = sorted(tf.getnames())
    assert names == ["logs/n0.log", "logs/n1.log", "logs/n2.log", "model.pt"]
    assert count == 4
    assert sorted(notes) == [
        "logs/big.log is left out (50 bytes; a file of logs/ is kept up to 40)",
        "logs/lightning_logs/version_0/last.ckpt is left out (at most 3 files of logs/ are kept)",
        "logs/link.log is left out (not a regular file)",
    ]
    monkeypatch.setattr(script_outputs, "MAX_ARCHIVED_LOG_FILES", 10)
    script_outputs.pack_outputs(outputs, tmp_path / "o.tar.gz", logs, notes.append)
    with tarfile.open(tmp_path / "o.tar.gz") as tf:
        assert tf.extractfile("logs/lightning_logs/version_0/last.ckpt").read() == b"\x00ckpt"  # type: ignore[union-attr]


def test_the_outputs_archive_keeps_within_what_the_api_accepts(tmp_path: Path) -> None:
    import tarfile

    import worker.agent.script_outputs as script_outputs

    outputs, logs = tmp_path / "outputs", tmp_path / "logs"
    outputs.mkdir()
    logs.mkdir()
    for i in range(5):
        (outputs / f"f{i}.bin").write_bytes(b"x" * 100)
    (logs / "run.log").write_text("log")
    # A file large enough to be sampled for its deflate level, read from the open descriptor
    # (whatever the current folder).
    (outputs / "sub").mkdir()
    (outputs / "sub" / "weights.pt").write_bytes(bytes(range(256)) * 64)
    script_outputs.pack_outputs(outputs, tmp_path / "whole.tar.gz", logs)
    with tarfile.open(tmp_path / "whole.tar.gz") as tf:
        assert tf.extractfile("sub/weights.pt").read() == bytes(range(256)) * 64  # type: ignore[union-attr]
    (outputs / "sub" / "weights.pt").unlink()
    (outputs / "sub").rmdir()
    notes: list[str] = []
    _sha, _size, count = script_outputs.pack_outputs(
        outputs, tmp_path / "o.tar.gz", logs, notes.append, max_files=3, max_bytes=10_000
    )
    with tarfile.open(tmp_path / "o.tar.gz") as tf:
        assert sorted(tf.getnames()) == ["f0.bin", "f1.bin", "f2.bin"] and count == 3
    assert notes == [
        "3 file(s) (203 bytes) are left out: the outputs archive holds at most 3 files and 10000 bytes "
        "uncompressed (f3.bin, f4.bin, logs/run.log)"
    ]
    notes.clear()
    script_outputs.pack_outputs(
        outputs, tmp_path / "o.tar.gz", logs, notes.append, max_files=100, max_bytes=250
    )
    with tarfile.open(tmp_path / "o.tar.gz") as tf:
        assert sorted(tf.getnames()) == ["f0.bin", "f1.bin", "logs/run.log"]
    assert len(notes) == 1 and notes[0].startswith("3 file(s) (300 bytes) are left out")


def test_files_written_in_the_working_copy_are_named_in_the_job_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every file a process wrote in its working copy, at any depth (Lightning's checkpoints,
    ``mnist/mnist_cnn.pt``), is named: not what the code package brought unchanged, not what
    went through ./outputs or ./logs, not ``__pycache__``; nor ``lightning_logs/`` when the
    outputs archive takes it."""
    import logging

    code = tmp_path / "code"
    (code / "data").mkdir(parents=True)
    (code / "train.py").write_text("print()")
    (code / "data" / "labels.txt").write_text("a\nb\n")
    (code / "data" / "same.txt").write_text("same")
    launch = _launch(tmp_path, node_rank=0, nproc=1, code_dir=code)
    group = ScriptGroup(launch, job_log=logging.getLogger("test.job"))
    group.close_tracking()
    group._prepare()
    cwd = group.processes[0].cwd
    (cwd / "model.pt").write_bytes(b"w")
    (cwd / "mnist").mkdir()
    (cwd / "mnist" / "mnist_cnn.pt").write_bytes(b"x" * 10)
    checkpoints = cwd / "lightning_logs" / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "epoch=1-step=4.ckpt").write_bytes(b"c")
    (cwd / "data" / "labels.txt").write_text("a\nc\n")  # changed, same size
    (cwd / "data" / "same.txt").write_text("same")  # written again as it was
    (cwd / "__pycache__").mkdir()
    (cwd / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    (cwd / "outputs" / "kept.pt").write_bytes(b"k")
    (cwd / "logs" / "run.log").write_text("kept")
    (cwd / "link.pt").symlink_to(cwd / "model.pt")
    ckpt = "lightning_logs/version_0/checkpoints/epoch=1-step=4.ckpt"
    with caplog.at_level(logging.WARNING, logger="test.job"):
        assert group.name_unkept_files() == [
            "rank-0/model.pt",
            "rank-0/data/labels.txt",
            f"rank-0/{ckpt}",
            "rank-0/mnist/mnist_cnn.pt",
        ]
    said = [r.getMessage() for r in caplog.records if r.name == "test.job"]
    assert said == [
        f"not kept: {name} was written in the working copy of rank-0, not under outputs/ "
        "(only outputs/ and logs/ are kept with the job)"
        for name in ("model.pt", "data/labels.txt", ckpt, "mnist/mnist_cnn.pt")
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test.job"):
        assert group.name_unkept_files(kept=("lightning_logs",)) == [
            "rank-0/model.pt",
            "rank-0/data/labels.txt",
            "rank-0/mnist/mnist_cnn.pt",
        ]
    assert "(only outputs/, logs/ and lightning_logs/ are kept with the job)" in caplog.text


def test_many_files_written_in_a_working_copy_are_named_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    group = ScriptGroup(_launch(tmp_path, node_rank=0, nproc=1), job_log=logging.getLogger("test.job"))
    group.close_tracking()
    group._prepare()
    cwd = group.processes[0].cwd
    (cwd / "data" / "raw").mkdir(parents=True)
    for i in range(30):
        (cwd / "data" / "raw" / f"part-{i:02}.bin").write_bytes(b"x" * 1000)
    (cwd / "zz").mkdir()
    (cwd / "zz" / "best.pth").write_bytes(b"w" * 100)
    with caplog.at_level(logging.WARNING, logger="test.job"):
        names = group.name_unkept_files()
    assert len(names) == 31
    said = [r.getMessage() for r in caplog.records if r.name == "test.job"]
    assert said == [
        "not kept: 31 files (30100 bytes) were written in the working copy of rank-0, not under outputs/ "
        "(only outputs/ and logs/ are kept with the job), among them zz/best.pth, data/raw/part-00.bin, "
        "data/raw/part-01.bin, data/raw/part-02.bin, data/raw/part-03.bin"
    ]


def test_the_outputs_archive_keeps_the_working_copies_lightning_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning writes its logs and checkpoints under ``lightning_logs/`` of the working
    directory: the outputs archive keeps them there, within their bounds, each file left out
    named."""
    import tarfile

    import worker.agent.script_outputs as script_outputs

    outputs, logs = tmp_path / "outputs", tmp_path / "logs"
    outputs.mkdir()
    logs.mkdir()
    (outputs / "model.pt").write_bytes(b"weights")
    (logs / "run.log").write_text("log")
    one, two = tmp_path / "rank-0" / "lightning_logs", tmp_path / "rank-1" / "lightning_logs"
    (one / "version_0" / "checkpoints").mkdir(parents=True)
    (one / "version_0" / "checkpoints" / "epoch=1-step=4.ckpt").write_bytes(b"\x00ckpt")
    (one / "version_0" / "metrics.csv").write_text("epoch,step,loss\n")
    (one / "version_0" / "hparams.yaml").symlink_to(tmp_path / "outputs" / "model.pt")
    (two / "version_0").mkdir(parents=True)
    (two / "version_0" / "metrics.csv").write_text("other")
    (two / "version_1").mkdir()
    (two / "version_1" / "big.ckpt").write_bytes(b"x" * 100)
    monkeypatch.setattr(script_outputs, "MAX_ARCHIVED_LIGHTNING_BYTES", 50)
    notes: list[str] = []
    _sha, _size, count = script_outputs.pack_outputs(
        outputs,
        tmp_path / "o.tar.gz",
        logs,
        notes.append,
        lightning_logs=[one, two, tmp_path / "rank-2" / "lightning_logs"],
    )
    with tarfile.open(tmp_path / "o.tar.gz") as tf:
        assert sorted(tf.getnames()) == [
            "lightning_logs/version_0/checkpoints/epoch=1-step=4.ckpt",
            "lightning_logs/version_0/metrics.csv",
            "logs/run.log",
            "model.pt",
        ]
        ckpt = tf.extractfile("lightning_logs/version_0/checkpoints/epoch=1-step=4.ckpt")
        assert ckpt is not None and ckpt.read() == b"\x00ckpt"
    assert count == 4
    assert sorted(notes) == [
        "lightning_logs/version_0/hparams.yaml is left out (not a regular file)",
        "lightning_logs/version_0/metrics.csv is left out (the outputs or another working copy hold a "
        "file of that name)",
        "lightning_logs/version_1/big.ckpt is left out (100 bytes; a file of lightning_logs/ is kept up to 50)",
    ]


def test_the_pip_environment_gets_the_worker_console_scripts(tmp_path: Path) -> None:
    from worker.agent.pip_env import add_console_scripts, env_python

    worker_bin, env_dir = tmp_path / "worker-bin", tmp_path / "env"
    worker_bin.mkdir()
    (env_dir / "bin").mkdir(parents=True)
    scripts = {
        "torchrun": "#!/opt/worker/bin/python3\nfrom torch.distributed.run import main\nmain()\n",
        "lightning": "#!/usr/bin/env python\nprint('hi')\n",
        "tool.sh": "#!/bin/sh\necho shell\n",  # not Python: left alone
        "activate": "#!/opt/worker/bin/python\n",
    }
    for name, text in scripts.items():
        (worker_bin / name).write_text(text)
        (worker_bin / name).chmod(0o755)
    (env_dir / "bin" / "lightning").write_text("#!env's own\n")  # the job's package wins
    assert add_console_scripts(env_dir, worker_bin) == ["torchrun"]
    copied = (env_dir / "bin" / "torchrun").read_text()
    assert copied == f"#!{env_python(env_dir)}\nfrom torch.distributed.run import main\nmain()\n"
    assert os.access(env_dir / "bin" / "torchrun", os.X_OK)
    assert (env_dir / "bin" / "lightning").read_text() == "#!env's own\n"
    assert add_console_scripts(env_dir, worker_bin) == []  # again: nothing to do


BURN = """
import json, os, time
with open(os.environ["TORCHYARD_METRICS_FILE"], "a") as f:
    f.write(json.dumps({"name": "loss", "value": 1.0, "step": 7, "rank": int(os.environ["RANK"])}) + "\\n")
end = time.time() + 2.0
n = 0
while time.time() < end:
    n += 1
"""


def test_the_agent_samples_each_script_process_into_the_job_metrics(tmp_path: Path) -> None:
    """Two real processes burn CPU for 2 s: the agent's sampler (TORCHYARD_SYS_METRICS_INTERVAL_S
    0.3) writes each rank's CPU and memory, which the reporter's reader takes as the job's
    metrics at the script's latest step of that rank."""
    import logging

    code = tmp_path / "code"
    code.mkdir()
    (code / "burn.py").write_text(BURN)
    launch = _launch(
        tmp_path,
        command=("python", "burn.py"),
        code_dir=code,
        variables={"MLFLOW_TRACKING_URI": "file:/dev/null"},
    )  # node rank 1: ranks 2 and 3
    env = {**os.environ, "TORCHYARD_SYS_METRICS_INTERVAL_S": "0.3"}
    group = ScriptGroup(launch, env=env, job_log=logging.getLogger("test.job"))
    agent_log = tmp_path / "agent.log"
    agent_log.write_text("")
    reader = RunFileReader("j", launch.run_dir, lambda: [], agent_log, "n1", group.metric_files)
    points: list[dict[str, object]] = []
    with open(agent_log, "a") as out:
        group.start(out)
    group.start_sampling(reader.latest_step)
    try:
        while group.wait(0.3) is None:
            points += reader.collect(final=False).metrics
    finally:
        group.close_tracking()
        group.kill_stragglers()
    assert group.wait(0) == 0
    points += reader.collect(final=True).metrics
    reader.close()
    keys = [(p["name"], p["rank"], p["step"], p.get("occurrence", 0)) for p in points]
    assert len(keys) == len(set(keys))  # each sample a point of its own
    for rank in (2, 3):
        cpu = [p for p in points if p["name"] == "sys.cpu_percent" and p["rank"] == rank]
        rss = [p for p in points if p["name"] == "sys.rss_bytes" and p["rank"] == rank]
        assert len(cpu) >= 2 and len(rss) >= 2, points
        assert max(float(p["value"]) for p in cpu) > 20  # a busy loop, on a shared machine
        assert all(float(p["value"]) > 1 << 20 for p in rss), [
            p["value"] for p in rss
        ]  # a Python interpreter's memory
        # Once the script's own point was read, the samples take its step.
        assert cpu[-1]["step"] == 7 and rss[-1]["step"] == 7
    assert not [p for p in points if str(p["name"]).startswith("sys.gpu")]  # no GPU here
    assert "sys.input_wait_fraction" not in {p["name"] for p in points}
