"""``environment.pip`` of script jobs: one virtual environment per requirement set and
node, built once under a lock for two jobs asking at the same time, over the worker's own
torch; a failed build is EnvironmentBuildError with pip's words. No network: the package
is a wheel built here, found through PIP_FIND_LINKS; the agent runs with PIP_NO_INDEX."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from tests.e2e.test_script_jobs import SCRIPT_SETTINGS
from tests.support.script_helpers import ScriptEnv, script_env


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
