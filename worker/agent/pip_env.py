"""Virtual environments for script jobs' ``environment.pip`` (docs/script-jobs.md).

One environment per requirement set and node, under ``<work dir>/envs/<key>/`` where the
key is the sha256 of the sorted requirements and the worker's Python version. It is
built with ``--system-site-packages`` and a ``.pth`` file naming the worker's own
site-packages, so the worker's torch is used rather than installed again. Every console
script of the worker's own environment (``torchrun``...) that the new one lacks is copied
into its ``bin/`` naming the new environment's interpreter, so whatever a job starts from
``PATH`` (``torchrun`` and the processes it starts included) runs with the job's packages
(docs/script-jobs.md). Builds run
under a per-key lock file: two jobs asking for the same set on one node build it once,
the second one waits and reuses it. An environment is ready once its marker file is
written after pip succeeded; a failed build leaves nothing behind and is an
``EnvironmentBuildError`` carrying pip's last lines. A build has the job's
``environment.build_timeout_s`` (``BUILD_TIMEOUT_S`` by default): past it every process
of the build is killed and the job fails, naming the timeout and how to raise it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

from torchyard.contract.errors import EnvironmentBuildError
from torchyard.contract.files import locked
from torchyard.contract.jobspec import DEFAULT_BUILD_TIMEOUT_S, MAX_BUILD_TIMEOUT_S
from worker.agent import sandbox
from worker.agent.job_env import SECRET_VARS
from worker.agent.job_tree import give_to
from worker.agent.sandbox import Sandbox

log = logging.getLogger(__name__)

PIP_TAIL_LINES = 30
BUILD_TIMEOUT_S = DEFAULT_BUILD_TIMEOUT_S
READY_MARKER = ".torchyard-ready"
SCRIPTS_MARKER = ".torchyard-scripts"
_SKIPPED_SCRIPTS = ("activate", "python", "pip")


def requirements_key(requirements: list[str]) -> str:
    """The cache key of a requirement set (order and duplicates do not matter)."""
    wanted = {"python": sys.version, "requirements": sorted(set(requirements))}
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:32]


def env_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _site_packages(env_dir: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return env_dir / "lib" / version / "site-packages"


class _BuildTimedOut(Exception):
    """The build ran past its deadline (its processes are killed)."""


def _run(
    command: list[str],
    log_file: Path,
    stop: threading.Event | None,
    box: Sandbox | None = None,
    *,
    deadline: float,
) -> int:
    """Run one step of a build; its exit code, -9 when ``stop`` was set. Past ``deadline``
    (``time.monotonic()``) its whole process group is killed and ``_BuildTimedOut`` raised."""
    env = None
    if box is not None:
        # In the sandbox: its processes (setup code of a package built from source) see the
        # environment's folder only, and all of them end with the build.
        command = box.command(command, box.writable)
        env = {k: v for k, v in os.environ.items() if k not in SECRET_VARS and not k.startswith("TORCHYARD_")}
        env.update(HOME="/tmp", PIP_NO_CACHE_DIR="1")
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        while True:
            try:
                return process.wait(0.2)
            except subprocess.TimeoutExpired:
                timed_out = time.monotonic() > deadline
                if timed_out or (stop is not None and stop.is_set()):
                    os.killpg(process.pid, 9)
                    process.wait()
                    if timed_out:
                        raise _BuildTimedOut() from None
                    return -9


def _local_find_links() -> list[Path]:
    """The local folders of the worker's ``PIP_FIND_LINKS`` (shown read-only to the build)."""
    found = []
    for entry in os.environ.get("PIP_FIND_LINKS", "").split():
        path = Path(entry.removeprefix("file://"))
        if path.is_absolute() and path.exists():
            found.append(path)
    return found


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _python_script(path: Path) -> bytes | None:
    """The body of a console script of a Python interpreter (after its ``#!`` line); None otherwise."""
    if path.is_symlink() or not path.is_file() or not os.access(path, os.X_OK):
        return None
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16)
    except OSError:
        return None
    first, _, rest = head.partition(b"\n")
    if not first.startswith(b"#!") or b"python" not in first or len(head) == 1 << 16:
        return None
    return rest


def add_console_scripts(env_dir: Path, worker_bin: Path | None = None) -> list[str]:
    """Copy the worker's console scripts the environment lacks into its ``bin/``, each run by
    the environment's interpreter; the names copied. Idempotent."""
    source = worker_bin or Path(sys.executable).parent
    target = env_dir / "bin"
    added = []
    for path in sorted(source.iterdir()):
        if path.name.startswith(_SKIPPED_SCRIPTS) or (target / path.name).exists():
            continue
        body = _python_script(path)
        if body is None:
            continue
        tmp = target / f".{path.name}.tmp"
        tmp.write_bytes(b"#!" + str(env_python(env_dir)).encode() + b"\n" + body)
        tmp.chmod(0o755)
        os.replace(tmp, target / path.name)
        added.append(path.name)
    (env_dir / SCRIPTS_MARKER).write_text("\n".join(added))
    return added


def _pip_install(
    work: Path,
    requirements: list[str],
    build_log: Path,
    stop: threading.Event | None,
    box: Sandbox | None,
    deadline: float,
) -> int:
    """pip installs ``requirements`` into the new environment ``work`` (in ``box``, as its
    user); pip's exit code."""
    # The worker's own packages (torch...) stay visible even when it runs in a venv: its
    # site folders are added as site folders (their .pth files count).
    base = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    lines = [f"import site; site.addsitedir({path!r})" for path in base]
    (_site_packages(work) / "_torchyard_worker.pth").write_text("\n".join(lines) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(env_python(work)), "install"]
    options = ["--disable-pip-version-check", "--no-input"]
    if box is not None:
        box.give_writable()  # pip runs as the sandbox's user (a root agent's: nobody)
    try:
        return _run([*pip, *options, *requirements], build_log, stop, box, deadline=deadline)
    finally:
        if box is not None and box.user is not None:
            # Built: the agent's again, shown read-only to the runs that use it.
            give_to(work, os.getuid(), os.getgid())


def ensure_environment(
    envs_dir: Path,
    requirements: list[str],
    *,
    stop: threading.Event | None = None,
    on_build: logging.Logger | None = None,
    hidden: list[Path] | None = None,
    timeout_s: float = BUILD_TIMEOUT_S,
) -> tuple[Path, bool]:
    """The folder of the environment for ``requirements``, and whether this call built it;
    pip runs in the node's sandbox (``hidden``: folders it never shows) unless it is off. A
    build longer than ``timeout_s`` (the job's ``environment.build_timeout_s``) is killed:
    ``EnvironmentBuildError`` naming the timeout."""
    key = requirements_key(requirements)
    envs_dir.mkdir(parents=True, exist_ok=True)
    final = envs_dir / key
    if (final / READY_MARKER).exists() and (final / SCRIPTS_MARKER).exists():
        return final, False
    with locked(envs_dir / f".{key}.lock"):
        if (final / READY_MARKER).exists():
            if not (final / SCRIPTS_MARKER).exists():
                add_console_scripts(final)  # built by an older worker
            return final, False  # another job built it while we waited
        # Built in place (a venv's scripts name their own folder), ready once the marker is
        # written: a folder without it is a build that was interrupted.
        work = final
        shutil.rmtree(work, ignore_errors=True)
        build_log = envs_dir / f".build-{key}.log"
        build_log.unlink(missing_ok=True)
        logger = on_build or log
        started = time.monotonic()
        deadline = started + timeout_s
        logger.info(
            "building the pip environment %s (at most %g s): %s", key, timeout_s, " ".join(requirements)
        )
        try:
            # No pip inside (fast): the worker's own pip installs into it (pip --python).
            code = _run(
                [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(work)],
                build_log,
                stop,
                deadline=deadline,
            )
            if code == 0:
                box = None
                if sandbox.mode() == sandbox.BWRAP:
                    box = sandbox.Sandbox(
                        writable=work, hidden=hidden or [envs_dir], read_only=_local_find_links()
                    )
                code = _pip_install(work, requirements, build_log, stop, box, deadline)
            if code != 0:
                tail = _tail(build_log, PIP_TAIL_LINES)
                raise EnvironmentBuildError(
                    f"pip could not build the environment for {requirements} (exit code {code}):\n{tail}",
                    details={"requirements": requirements},
                )
            add_console_scripts(work)
            (work / READY_MARKER).write_text(json.dumps({"requirements": requirements}))
        except _BuildTimedOut:
            shutil.rmtree(work, ignore_errors=True)
            tail = _tail(build_log, PIP_TAIL_LINES)
            raise EnvironmentBuildError(
                f"the pip environment for {requirements} was not built within {timeout_s:g} s "
                f"(environment.build_timeout_s): the build was stopped. If its packages need longer "
                f"to build, submit the job again with a larger environment.build_timeout_s (at most "
                f"{MAX_BUILD_TIMEOUT_S} s). pip's last lines:\n{tail}",
                details={"requirements": requirements, "build_timeout_s": timeout_s},
            ) from None
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        logger.info("pip environment %s built in %.1f s", key, time.monotonic() - started)
        return final, True
