"""Packaging (README.md): each part installs, and imports, only what it needs.

- the API process never imports torch or torchvision (it never trains);
- the CLI and the Python client import no torch, FastAPI or SQLAlchemy for client commands;
- the worker imports none of the API's dependencies;
- pyproject.toml declares the base install and the extras accordingly;
- commands that need an extra which is missing say which one in one line and exit 2;
- a real client-only install (slow) has the ``torchyard`` command and no torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import venv
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from torchyard import cli
from torchyard.architectures import CLASSIFICATION_ARCHITECTURES, closest_architecture
from torchyard.extras import EXTRA_MODULES, extra_providing

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TORCH = {"torch", "torchvision"}
SERVER_ONLY = {"fastapi", "starlette", "sqlalchemy", "alembic", "uvicorn", "pydantic_settings"}


def run_python(code: str, *args: str, cwd: Path = ROOT) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TORCHYARD_TOKEN", None)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


# --------------------------------------------------------------------------- imports


def test_api_process_never_imports_torch(tmp_path: Path) -> None:
    """The app is created and started (migrations, admin token, background tasks), answers
    /healthz and /docs, validates job architectures, takes a dataset upload and queues a
    job, all without torch (or anything else that only the worker extra installs)."""
    out = run_python(
        """
        import io, json, sys, tarfile
        from pathlib import Path
        from fastapi.testclient import TestClient
        from PIL import Image
        from service.api.app import create_app
        from service.config import Settings

        data = Path(sys.argv[1])
        settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'api.db'}")
        seen = {}
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = "Bearer " + settings.admin_token_path.read_text().strip()
            seen["healthz"] = client.get("/healthz").status_code
            seen["docs"] = client.get("/docs").status_code
            seen["openapi"] = client.get("/openapi.json").status_code
            job = {"train_dataset": "nope", "validation_dataset": "nope"}
            typo = client.post("/v1/jobs", json={**job, "model": {"architecture": "ResNet18"}})
            seen["typo"] = [typo.status_code, typo.json().get("details", {}).get("suggestion")]
            known = client.post("/v1/jobs", json={**job, "model": {"architecture": "resnet18"}})
            seen["known"] = [known.status_code, known.json().get("code")]
            # a dataset upload (every image decoded) and a job that is queued
            with tarfile.open(data / "pets.tar", "w") as tar:
                for n, label in enumerate(("cat", "dog") * 2):
                    png = io.BytesIO()
                    Image.new("RGB", (16, 16), (60 * n, 90, 40)).save(png, "PNG")
                    member = tarfile.TarInfo(f"{label}/{n}.png")
                    member.size = png.tell()
                    png.seek(0)
                    tar.addfile(member, png)
            with open(data / "pets.tar", "rb") as fh:
                up = client.post("/v1/datasets", data={"name": "pets"}, files={"file": ("pets.tar", fh)})
            seen["upload"] = up.status_code
            pets = up.json().get("id")
            # a node for the job to wait for
            worker = client.post("/v1/tokens", json={"name": "w", "role": "worker"}).json()["token"]
            client.post("/v1/worker/nodes", headers={"Authorization": f"Bearer {worker}"},
                        json={"name": "n", "address": "127.0.0.1", "units": 1, "accelerator": "cpu"})
            queued = client.post("/v1/jobs", json={"model": {"architecture": "resnet18"},
                                                   "train_dataset": pets, "validation_dataset": pets})
            seen["queued"] = [queued.status_code, queued.json().get("status")]
        # nothing that only the worker extra installs (a server-only install has none of it)
        worker_only = ("torch", "torchvision", "safetensors", "numpy", "sklearn")
        seen["loaded"] = sorted(m for m in worker_only if m in sys.modules)
        print(json.dumps(seen))
        """,
        str(tmp_path / "data"),
    )
    assert out["healthz"] == out["docs"] == out["openapi"] == 200
    assert out["typo"] == [422, "resnet18"]
    # past the architecture check: refused for the unknown dataset, not the model
    assert out["known"][0] in (404, 422) and out["known"][1] != "InvalidModelDirectoryError"
    assert out["upload"] == 201
    assert out["queued"] == [201, "queued"]
    assert out["loaded"] == []


def test_serve_module_never_imports_torch() -> None:
    out = run_python(
        """
        import json, sys
        import service.serving, service.api.app, service.services.jobs, service.datasets
        print(json.dumps({"loaded": sorted(m for m in ("torch", "torchvision") if m in sys.modules)}))
        """
    )
    assert out["loaded"] == []


def test_client_and_cli_import_no_server_or_worker_parts() -> None:
    """Importing the client modules, building the parser, printing help and running a client
    command (against a closed port) load neither torch nor the API's frameworks."""
    port = free_port()
    out = run_python(
        f"""
        import contextlib, io, json, sys
        import torchyard, torchyard.client, torchyard.commands, torchyard.terminal, torchyard.cli
        from torchyard.cli import build_parser, main

        build_parser()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["--help"])
        with contextlib.redirect_stderr(io.StringIO()) as err:
            rc = main(["jobs", "--url", "http://127.0.0.1:{port}", "--token", "t"])
        heavy = {sorted(TORCH | SERVER_ONLY | {"numpy", "PIL", "safetensors"})!r}
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in heavy)
        print(json.dumps({{"rc": rc, "err": err.getvalue(), "loaded": loaded}}))
        """
    )
    assert out["rc"] == 3, out["err"]  # the service is unreachable: the command itself ran
    assert out["loaded"] == []


def test_worker_imports_none_of_the_api_parts() -> None:
    out = run_python(
        f"""
        import json, sys
        import worker.agent.agent, worker.agent.main, worker.trainer.runner
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in {sorted(SERVER_ONLY)!r})
        print(json.dumps({{"loaded": loaded}}))
        """
    )
    assert out["loaded"] == []


def test_architecture_list_matches_torchvision() -> None:
    torchvision = pytest.importorskip("torchvision")
    assert set(torchvision.models.list_models(module=torchvision.models)) == CLASSIFICATION_ARCHITECTURES
    assert closest_architecture("ResNet18") == "resnet18"
    assert closest_architecture("densnet121") == "densenet121"
    assert closest_architecture("fasterrcnn_resnet50_fpn") is None


# --------------------------------------------------------------------------- declared metadata


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(extra: str | None = None) -> set[str]:
    """The distribution names the base install (``extra=None``) or an extra brings, with
    ``torchyard[...]`` self-references resolved."""
    project = PYPROJECT["project"]
    declared = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    names: set[str] = set()
    for requirement in declared:
        name = _name(requirement)
        if name == project["name"]:
            inner = re.search(r"\[(.*?)\]", requirement)
            assert inner is not None, requirement
            for sub in inner.group(1).split(","):
                names |= requirements(sub.strip())
        else:
            names.add(name)
    return names


def test_base_install_is_the_client_only() -> None:
    base = requirements()
    assert base == {"httpx", "pydantic", "pyyaml"}
    assert not base & {"torch", "torchvision", "fastapi", "sqlalchemy", "uvicorn", "alembic", "numpy"}


def test_extras_split_server_and_worker() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"server", "worker", "all", "dev"} <= set(extras)
    server, worker, everything = requirements("server"), requirements("worker"), requirements("all")
    assert {"fastapi", "sqlalchemy", "uvicorn", "alembic", "psycopg", "pydantic-settings"} <= server
    assert not server & {"torch", "torchvision", "safetensors", "numpy", "scikit-learn"}
    assert {"torch", "torchvision", "safetensors"} <= worker
    assert not worker & {"fastapi", "sqlalchemy", "uvicorn", "alembic"}
    assert server | worker <= everything
    # torch stays pinned where it is declared
    pins = [r for r in extras["worker"] if _name(r) in ("torch", "torchvision")]
    assert sorted(pins) == ["torch==2.14.1", "torchvision==0.29.1"]
    # the two set-up commands install everything
    assert ".[all,dev]" in (ROOT / "Makefile").read_text()


def test_extra_modules_come_from_their_extra() -> None:
    """Every module the CLI checks for before a command is installed by the extra it names."""
    providers = importlib.metadata.packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        declared = requirements(extra)
        for module in modules:
            dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
            assert dists, f"{module} is not installed here"
            assert dists & declared, (extra, module, dists)
    assert extra_providing("torch.nn") == "worker"
    assert extra_providing("sqlalchemy.orm") == "server"
    assert extra_providing("httpx") is None


# --------------------------------------------------------------------------- missing extras


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "hidden", "extra"),
    [
        (["serve"], "fastapi", "server"),
        (["serve", "--with-worker"], "torch", "worker"),
        (["db", "upgrade"], "sqlalchemy", "server"),
        (["token", "create", "--role", "user", "--name", "x"], "alembic", "server"),
        (["worker", "--api", "http://127.0.0.1:9"], "torchvision", "worker"),
        (["predict", "model", "image.png"], "torch", "worker"),
        (["demo"], "sklearn", "all"),
    ],
)
def test_missing_extra_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
    hidden: str,
    extra: str,
) -> None:
    # A module set to None in sys.modules is one Python cannot find or import.
    monkeypatch.setitem(sys.modules, hidden, None)
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: torchyard {argv[0]}")
    assert f"no module {hidden}" in line
    assert f"pip install 'torchyard[{extra}]'" in line
    assert not (tmp_path / "torchyard-data").exists()  # refused before doing anything


def test_unforeseen_missing_module_still_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A module of an extra missing past the up-front check: the same single line."""
    monkeypatch.setattr("torchyard.commands.require", lambda *_args: None)
    monkeypatch.delitem(sys.modules, "torchyard.modeldir", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert cli.main(["predict", "model", "image.png"]) == 2
    line = _one_error_line(capsys)
    assert "pip install 'torchyard[worker]'" in line and "no module torch" in line


# --------------------------------------------------------------------------- a real install


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


@pytest.mark.slow
def test_client_only_install(tmp_path: Path) -> None:
    """``pip install torchyard`` (from this source tree) into a fresh venv: the command and the
    client work, and neither torch nor the API's frameworks came with them."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in ("torchyard", "service", "worker", "migrations"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(source)],
        capture_output=True, text=True, env=env, timeout=540, check=False,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    # run from the temp dir: this checkout must not be importable from the working directory
    helped = subprocess.run(
        [str(env_dir / "bin" / "torchyard"), "--help"], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert helped.returncode == 0, helped.stderr
    assert "predict" in helped.stdout and "serve" in helped.stdout
    probe = subprocess.run(
        [str(python), "-c",
         "import importlib.util, json, sys, torchyard.client, torchyard.cli; "
         "print(json.dumps({'file': torchyard.client.__file__, 'absent': [m for m in "
         "('torch', 'torchvision', 'fastapi', 'sqlalchemy', 'uvicorn', 'numpy') "
         "if importlib.util.find_spec(m) is None]}))"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert Path(found["file"]).is_relative_to(env_dir)
    assert found["absent"] == ["torch", "torchvision", "fastapi", "sqlalchemy", "uvicorn", "numpy"]
    # a command that needs an extra says so
    refused = subprocess.run(
        [str(env_dir / "bin" / "torchyard"), "serve"], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "pip install 'torchyard[server]'" in refused.stderr
    # torch alone is hundreds of MiB: the whole client install stays far below that
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    size_mib = _dir_bytes(site) / 2**20
    print(f"client-only site-packages: {size_mib:.1f} MiB")
    assert size_mib < 80


def test_docs_say_which_extra_for_which_part() -> None:
    readme = (ROOT / "README.md").read_text()
    cluster = (ROOT / "docs" / "running-on-a-cluster.md").read_text()
    for line in (
        "pip install torchyard`",
        "pip install 'torchyard[server]'",
        "pip install 'torchyard[worker]'",
    ):
        assert line in readme and line in cluster, line
    assert "pip install 'torchyard[all]'" in readme and ".[all,dev]" in readme
    assert "--target api" in cluster and "--target worker" in cluster
