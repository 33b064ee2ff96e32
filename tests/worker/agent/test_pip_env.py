"""``environment.pip`` of script jobs: one virtual environment per requirement set and
node, built once under a lock for two jobs asking at the same time, over the worker's own
torch; a failed build is EnvironmentBuildError with pip's words. No network: the package
is a wheel built here, found through PIP_FIND_LINKS; the agent runs with PIP_NO_INDEX."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from tests.e2e.test_script_jobs import SCRIPT_SETTINGS
from tests.support.script_helpers import ScriptEnv, script_env
from tests.support.worker_fixtures import wait_until_gone
from torchyard.contract.errors import EnvironmentBuildError
from torchyard.contract.files import locked
from worker.agent.pip_env import ensure_environment, requirements_key


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    settings: Settings = make_settings(**SCRIPT_SETTINGS)
    return settings


@pytest.fixture
def env(settings: Settings, tmp_path: Path) -> Iterator[ScriptEnv]:
    with script_env(settings, tmp_path) as e:
        yield e


def build_wheel(folder: Path, name: str = "tinypkg", version: str = "0.1") -> Path:
    """A pure-Python wheel holding ``{name}.VALUE = 42``, built without any tool."""
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


USES = """
import sys, torch, tinypkg
from torchyard import run
(run.output_dir() / "seen.txt").write_text(f"{tinypkg.VALUE} {sys.prefix} {torch.__version__}")
"""


TORCHRUN = ["torchrun", "--nnodes", "$NNODES", "--nproc-per-node", "$NPROC_PER_NODE", "--node-rank",
            "$NODE_RANK", "--master-addr", "$MASTER_ADDR", "--master-port", "$MASTER_PORT", "uses.py"]  # fmt: skip


def test_one_environment_built_once_for_two_jobs(env: ScriptEnv, tmp_path: Path) -> None:
    """The second job's command is ``torchrun`` (per node): the environment's own, so the
    process it starts has the job's package too (a package the worker does not have)."""
    wheel = build_wheel(tmp_path / "wheels")
    agent = env.agent("solo", slots=2, env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheel.parent)})
    code = env.upload_code({"uses.py": USES})
    pip = {"pip": ["tinypkg==0.1"]}  # from the wheel folder (PIP_FIND_LINKS)
    jobs = [
        env.submit(code, ["python", "uses.py"], environment=pip),
        env.submit(code, TORCHRUN, environment=pip, distribution={"launch": "per_node"}),
    ]
    prefixes = set()
    for job_id in jobs:
        job = env.wait(job_id)
        assert job["status"] == "succeeded", (job, env.log(job_id, stream="agent"))
        value, prefix, torch_version = env.outputs(job_id)["seen.txt"].decode().split()
        assert value == "42" and torch_version  # the package, and the worker's own torch
        prefixes.add(prefix)
    envs = [p for p in (agent.work_dir / "envs").iterdir() if not p.name.startswith(".")]
    assert len(envs) == 1 and prefixes == {str(envs[0])}
    logs = [env.log(job_id, stream="agent") for job_id in jobs]
    assert sum("pip environment" in text and "built in" in text for text in logs) == 1, logs
    assert sum(f"pip environment {envs[0].name} reused" in text for text in logs) == 1, logs


def test_a_failed_build_is_an_environment_build_error(env: ScriptEnv, tmp_path: Path) -> None:
    agent = env.agent("solo", slots=1, env={"PIP_NO_INDEX": "1"})
    code = env.upload_code({"uses.py": USES})
    job_id = env.submit(code, ["python", "uses.py"], environment={"pip": ["absent-package==0.1"]})
    job = env.wait(job_id)
    assert job["status"] == "failed"
    assert job["failure"]["code"] == "EnvironmentBuildError", job["failure"]
    assert "absent-package" in job["failure"]["message"]  # pip's own words
    assert [p for p in (agent.work_dir / "envs").iterdir() if not p.name.startswith(".")] == []


def build_hanging_sdist(folder: Path, name: str = "hangpkg", version: str = "0.1") -> Path:
    """A source package whose build never ends: its in-tree build backend sleeps an hour."""
    base = f"{name}-{version}"
    files = {
        f"{base}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{base}/pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "hang_backend"\n'
        b'backend-path = ["."]\n',
        f"{base}/hang_backend.py": b"import time\ntime.sleep(3600)\n",
    }
    folder.mkdir(parents=True, exist_ok=True)
    sdist = folder / f"{base}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return sdist


def test_a_build_past_its_timeout_is_stopped_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package whose build hangs: the build is killed at the job's build timeout (here 3 s,
    not the default 900 s), nothing of it is left (no process, no folder, the lock free), and
    the error names ``environment.build_timeout_s``. Outside the sandbox: the timeout is
    the subject here (the sandboxed build is one process group too, killed the same way)."""
    links = build_hanging_sdist(tmp_path / "sdists").parent
    monkeypatch.setenv("TORCHYARD_SANDBOX", "off")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    envs = tmp_path / "envs"
    started = time.monotonic()
    with pytest.raises(EnvironmentBuildError) as caught:
        ensure_environment(envs, ["hangpkg==0.1"], timeout_s=3)
    took = time.monotonic() - started
    assert 3 <= took < 30, took  # it hung until the timeout, not failed at once
    message = caught.value.message
    assert "not built within 3 s (environment.build_timeout_s)" in message, message
    assert "larger environment.build_timeout_s (at most 7200 s)" in message, message
    assert "Getting requirements to build wheel: started" in message, message  # the backend hung
    assert caught.value.details["build_timeout_s"] == 3
    assert wait_until_gone(str(links), timeout=5) == []  # the backend's sleep was killed with pip
    assert [p for p in envs.iterdir() if not p.name.startswith(".")] == []
    with locked(envs / f".{requirements_key(['hangpkg==0.1'])}.lock", blocking=False):
        pass  # the next job asking for this set builds it at once
