"""Every run in a sandbox of its own: bubblewrap (``bwrap``).

A run's processes (the trainer's torchrun and ranks, a script job's processes, the pip
build of a job's environment) start inside ``bwrap`` with:

- a mount namespace that shows the system read-only (``/usr``, ``/etc``, the ``/lib``
  folders, ``/opt``, ``/sys``), the Python installation and torchyard's own packages
  read-only, the run's directory writable, its inputs (datasets, the initial model, the
  job's pip environment, the offline torch hub) read-only, a fresh ``/proc``, a minimal
  ``/dev`` (GPU devices bound in when the run holds GPUs) and a private ``/tmp`` and
  ``/dev/shm``. Nothing else: not the data directory, not the agent's work directory (its
  tokens, its key, the dataset cache, other runs, other jobs' environments), not ``/home``
  nor ``/root``;
- a PID namespace of its own, whose first process is bwrap's: when the command exits,
  or when the agent kills the sandbox, the kernel kills every process left in it,
  however it detached (a new session, a double fork, an empty environment);
- no capabilities (``--cap-drop ALL``), even when the agent runs as root.

The network, the GPUs the run was given, and the user id are shared with the agent.

``TORCHYARD_SANDBOX=off`` runs everything without it (a machine without bubblewrap, an
operator's explicit choice); without it and without a working ``bwrap``, the node
refuses script jobs and says so in ``GET /v1/cluster``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SANDBOX_VAR = "TORCHYARD_SANDBOX"
# What a node reports (node info "sandbox" and GET /v1/cluster).
BWRAP = "bwrap"
OFF = "off"
UNAVAILABLE = "unavailable"
# The system folders shown read-only, when they exist.
_SYSTEM = ("/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys")
# Device nodes a GPU run needs (bound only when the run holds GPUs).
_GPU_DEVICES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
    "/dev/dri",
)
# The exit status bwrap gives for a command killed by a signal: 128 + the signal.
_SIGNAL_BASE = 128


@functools.lru_cache(maxsize=1)
def _bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=1)
def _bwrap_works() -> tuple[bool, str]:
    """Whether ``bwrap`` starts a sandbox here (it may be installed but not allowed to)."""
    path = _bwrap_path()
    if path is None:
        return False, "bubblewrap (bwrap) is not installed"
    probe = [path, *system_binds(), "--proc", "/proc", "--dev", "/dev", "--unshare-pid"]
    probe += ["--die-with-parent", "--cap-drop", "ALL", "--", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bwrap could not start: {exc}"
    if done.returncode != 0:
        return False, f"bwrap could not start a sandbox: {done.stderr.strip()[-300:]}"
    return True, ""


def mode(environ: dict[str, str] | None = None) -> str:
    """``bwrap``, ``off`` (``TORCHYARD_SANDBOX=off``) or ``unavailable`` (no working bwrap)."""
    value = (os.environ if environ is None else environ).get(SANDBOX_VAR, "").strip().lower()
    if value in ("off", "0", "false", "no"):
        return OFF
    return BWRAP if _bwrap_works()[0] else UNAVAILABLE


def unavailable_reason() -> str:
    return _bwrap_works()[1]


def system_binds() -> list[str]:
    args: list[str] = []
    for folder in _SYSTEM:
        path = Path(folder)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), folder]
        elif path.is_dir():
            args += ["--ro-bind", folder, folder]
    return args


@functools.lru_cache(maxsize=1)
def python_paths() -> tuple[Path, ...]:
    """What the worker's Python and torchyard's packages need to run, read-only."""
    import torchyard
    import worker

    found: list[Path] = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent]
    found += [Path(p) for p in sysconfig.get_paths().values()]
    found += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    # An editable install imports the packages from the source tree: those folders only.
    found += [Path(torchyard.__file__).parent, Path(worker.__file__).parent]
    resolved = []
    for path in found:
        if path.exists():
            resolved.append(path.absolute())
            resolved.append(path.resolve())
    return tuple(_outermost(resolved))


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """The paths without those inside another one of them (each bound once)."""
    unique = sorted(set(paths), key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in unique:
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


def torch_hub_dir(environ: Mapping[str, str]) -> Path:
    """torch's hub folder for this environment (the offline pretrained weights)."""
    if environ.get("TORCH_HOME"):
        return Path(environ["TORCH_HOME"]) / "hub"
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(
        environ.get("HOME") or os.path.expanduser("~"), ".cache"
    )
    return Path(cache) / "torch" / "hub"


@dataclass
class Sandbox:
    """One run's view of the machine."""

    writable: Path  # the run's directory
    hidden: Sequence[Path] = ()  # folders never shown, even inside a read-only path (the work dir)
    read_only: list[Path] = field(default_factory=list)
    gpus: bool = False
    shared_shm: Path | None = None  # a host folder shown as /dev/shm (else a private one)

    def command(self, argv: Sequence[str], cwd: Path) -> list[str]:
        bwrap = _bwrap_path()
        assert bwrap is not None
        args = [bwrap, "--die-with-parent", "--unshare-pid", "--cap-drop", "ALL", *system_binds()]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        if self.shared_shm is not None:
            # The processes of one run (each in a sandbox of its own) share their /dev/shm.
            args += ["--bind", str(self.shared_shm), "/dev/shm"]
        else:
            args += ["--tmpfs", "/dev/shm"]
        # After the private /tmp and /dev/shm: a Python or source tree under /tmp (a checkout
        # there, an editable install) shows on top of them.
        for path in python_paths():
            args += ["--ro-bind", str(path), str(path)]
        if self.gpus:
            devices = [str(p) for p in Path("/dev").glob("nvidia[0-9]*")] + list(_GPU_DEVICES)
            for device in devices:
                args += ["--dev-bind-try", device, device]
        for path in self.hidden:
            # The agent's files may lie under a path shown read-only (a work directory inside
            # the source tree): an empty folder over them.
            if any(Path(path).is_relative_to(p) for p in python_paths()):
                args += ["--tmpfs", str(path)]
        args += ["--bind", str(self.writable), str(self.writable)]
        for path in self.read_only:
            if path.exists():
                args += ["--ro-bind", str(path), str(path)]
        args += ["--chdir", str(cwd), "--"]
        return args + list(argv)


def exit_code(code: int | None) -> int | None:
    """bwrap's exit status as Popen's: a command killed by signal N is -N, not 128 + N."""
    if code is not None and _SIGNAL_BASE < code < _SIGNAL_BASE + 65:
        return -(code - _SIGNAL_BASE)
    return code


def is_sandbox_process(pid: int) -> bool:
    """A bwrap process (the sandbox's monitor or its PID 1): signalled only with SIGKILL,
    which ends the whole sandbox."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip() == "bwrap"
    except OSError:
        return False
