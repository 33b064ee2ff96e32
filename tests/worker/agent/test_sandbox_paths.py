"""What a sandboxed run sees of the machine it runs on, with a real bubblewrap: never the
folder the agent started in (which holds the service's data directory after
``torchyard serve --with-worker``), nor a folder named to be hidden, wherever it lies; and
``serve`` starts its worker outside that folder, with ``-P``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.sandbox_helpers import require_sandbox

# Run by an interpreter started in ``start`` the way ``serve`` started its worker before
# (``python -m ...`` in serve's folder: that folder is on sys.path), it builds a run's sandbox
# and asks a Python inside it what it can read.
_AGENT = textwrap.dedent(
    """
    import json, subprocess, sys
    from pathlib import Path
    from worker.agent.sandbox import Sandbox

    run, targets = Path(sys.argv[1]), json.loads(sys.argv[2])
    probe = "import json, sys\\nfound = []\\nfor t in json.loads(sys.argv[1]):\\n" \\
        "    try:\\n        open(t, 'rb').read(1)\\n        found.append(t)\\n" \\
        "    except OSError:\\n        pass\\nprint(json.dumps(found))"
    box = Sandbox(writable=run, hidden=[])
    argv = box.command([sys.executable, "-c", probe, json.dumps(targets)], run)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    print(done.stdout.strip() or done.stderr)
    """
)


def _readable_in_a_run(start: Path, run: Path, targets: list[str], env: dict[str, str]) -> list[str]:
    """What a run's sandbox, built by an agent started with ``python -m`` in ``start``, can read."""
    run.mkdir(parents=True, exist_ok=True)
    (start / "sandbox_probe.py").write_text(_AGENT)
    done = subprocess.run(
        [sys.executable, "-m", "sandbox_probe", str(run), json.dumps(targets)],
        cwd=start,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_the_folder_the_agent_started_in_and_its_data_directory_stay_out_of_the_sandbox(
    tmp_path: Path,
) -> None:
    require_sandbox()
    start = tmp_path / "project"
    data = start / "torchyard-data"
    data.mkdir(parents=True)
    (data / "admin.token").write_text("admin-secret")
    (start / "notes.txt").write_text("the start folder")
    pythonpath = tmp_path / "on-pythonpath"
    pythonpath.mkdir()
    (pythonpath / "secret.txt").write_text("a PYTHONPATH folder")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env["PYTHONPATH"] = str(pythonpath)
    targets = [str(data / "admin.token"), str(start / "notes.txt"), str(pythonpath / "secret.txt")]
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "own.txt").write_text("the run's own file")
    import torchyard

    shown = [str(run / "own.txt"), torchyard.__file__]
    assert _readable_in_a_run(start, run, [*targets, *shown], env) == shown


def test_a_hidden_folder_under_a_shown_one_is_covered(tmp_path: Path) -> None:
    """TORCHYARD_SANDBOX_HIDE (what serve names its data directory in) hides a folder even
    where it lies under something the sandbox shows: here, inside torchyard's own package
    folder, which every run sees read-only."""
    require_sandbox()
    import worker

    package = Path(worker.__file__).parent
    hidden = package / f".hidden-data-{os.getpid()}"
    hidden.mkdir()
    try:
        (hidden / "worker.token").write_text("worker-secret")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        shown = str(Path(worker.__file__))
        found = _readable_in_a_run(
            tmp_path, tmp_path / "runs" / "r1", [str(hidden / "worker.token"), shown], env
        )
        assert found == [str(hidden / "worker.token"), shown]  # shown with the package...
        env["TORCHYARD_SANDBOX_HIDE"] = str(hidden)
        env_found = _readable_in_a_run(
            tmp_path, tmp_path / "runs" / "r2", [str(hidden / "worker.token"), shown], env
        )
        assert env_found == [shown]  # ...unless named to be hidden
    finally:
        (hidden / "worker.token").unlink(missing_ok=True)
        hidden.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root agent changes the run's user")
def test_a_root_agents_run_is_the_sandbox_user_and_reads_no_root_file(tmp_path: Path) -> None:
    require_sandbox()
    from worker.agent.sandbox import Sandbox

    run = tmp_path / "run"
    run.mkdir()
    (run / "inputs").mkdir()
    (run / "inputs" / "x").write_text("input")
    box = Sandbox(writable=run, not_given=[run / "inputs"])
    assert box.user == (65534, 65534)
    box.give_writable()
    assert run.stat().st_uid == 65534 and (run / "inputs" / "x").stat().st_uid == 0
    probe = (
        "import os\ntry:\n    open('/etc/shadow','rb').read(1); s='read'\nexcept OSError as e:\n    s=type(e).__name__\n"
        "open('mine.txt','w').write('ok')\n"
        "print(os.getuid(), os.getgid(), os.getgroups(), s, open('/proc/self/status').read().split('CapBnd:')[1].split()[0])"
    )
    done = subprocess.run(
        box.command([sys.executable, "-c", probe], run), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    uid, gid, groups, shadow, bounding = done.stdout.split(maxsplit=2)[0:2] + done.stdout.split()[2:]
    assert (uid, gid) == ("65534", "65534")
    assert groups == "[]" and shadow == "PermissionError" and int(bounding, 16) == 0, done.stdout
    assert (run / "mine.txt").stat().st_uid == 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root agent changes the run's user")
def test_the_run_user_is_named_by_the_setting_and_root_only_on_request() -> None:
    from worker.agent.sandbox import run_user

    assert run_user({}) == (65534, 65534)
    assert run_user({"TORCHYARD_SANDBOX_USER": "root"}) is None
    assert run_user({"TORCHYARD_SANDBOX_USER": "1234:5678"}) == (1234, 5678)
    with pytest.raises(ValueError, match="no such user"):
        run_user({"TORCHYARD_SANDBOX_USER": "no-such-user-here"})
