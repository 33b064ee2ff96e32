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

- the processes of the run as an unprivileged user when the agent runs as root
  (``TORCHYARD_SANDBOX_USER``, ``nobody`` by default; see :func:`run_user`): bwrap (root)
  builds the mounts, then ``setpriv`` changes to that user, clears the supplementary
  groups, the capabilities and their bounding set, and sets ``no_new_privs`` before the
  command starts. Root-only files of the host stay unreadable to the run whatever else
  fails; the run's directory is given to that user before the run starts (its inputs,
  hard links to the node's dataset cache, are not).

The Python paths shown are the interpreter's installation, the site-packages and
torchyard's own package folders only: never the folder the agent was started from, nor
``PYTHONPATH`` folders, which may hold the service's data directory. Folders named in
``hidden`` (the agent's work directory, the service's data directory of
``torchyard serve --with-worker``, ``TORCHYARD_SANDBOX_HIDE``) are covered by an empty
folder wherever they lie under something shown.

The network and the GPUs the run was given are shared with the agent.

``TORCHYARD_SANDBOX=off`` runs everything without it (a machine without bubblewrap, an
operator's explicit choice); without it and without a working ``bwrap``, the node
refuses script jobs and says so in ``GET /v1/cluster``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchyard.contract.jobspec import SANDBOX_HIDE_VARIABLE
from worker.agent.job_tree import give_to

SANDBOX_VAR = "TORCHYARD_SANDBOX"
# The user the runs' processes become when the agent is root (a name, a uid or uid:gid).
USER_VAR = "TORCHYARD_SANDBOX_USER"
DEFAULT_USER = "nobody"
DEFAULT_IDS = (65534, 65534)  # nobody's uid and gid where the name is not known
# More folders never shown to a run (os.pathsep-separated): a data directory beside the agent.
HIDE_VAR = SANDBOX_HIDE_VARIABLE
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
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return False, "setpriv (util-linux) is not installed: a root agent needs it to run jobs unprivileged"
    return True, ""


@functools.lru_cache(maxsize=4)
def _user_from(value: str) -> tuple[int, int]:
    import grp
    import pwd

    if value.replace(":", "").isascii() and value.replace(":", "").isdigit():
        uid_text, _, gid_text = value.partition(":")
        uid = int(uid_text)
        if gid_text:
            return uid, int(gid_text)
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except KeyError:
            return uid, uid
    name, _, group = value.partition(":")
    try:
        entry = pwd.getpwnam(name)
    except KeyError as exc:
        raise ValueError(f"{USER_VAR}={value}: no such user on this machine") from exc
    gid = entry.pw_gid
    if group:
        try:
            gid = int(group) if group.isascii() and group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError as exc:
            raise ValueError(f"{USER_VAR}={value}: no such group on this machine") from exc
    return entry.pw_uid, gid


def run_user(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """The (uid, gid) a run's processes take: when the agent is root, ``TORCHYARD_SANDBOX_USER``
    (``nobody`` by default; ``root`` keeps root, which an operator must ask for by name);
    otherwise None: an unprivileged agent's runs keep its user (the sandbox still hides
    everything of the agent's)."""
    if os.geteuid() != 0:
        return None
    value = (os.environ if environ is None else environ).get(USER_VAR, "").strip()
    if not value:
        try:
            uid, gid = _user_from(DEFAULT_USER)
        except ValueError:  # a minimal image without a nobody entry: its usual ids
            uid, gid = DEFAULT_IDS
    else:
        uid, gid = _user_from(value)
    return None if uid == 0 else (uid, gid)


def hidden_from_environment(environ: Mapping[str, str] | None = None) -> list[Path]:
    """The folders of ``TORCHYARD_SANDBOX_HIDE``."""
    value = (os.environ if environ is None else environ).get(HIDE_VAR, "")
    return [Path(p) for p in value.split(os.pathsep) if p.strip()]


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
    # Not the entries of sys.path: the first is the folder the agent started in (or a
    # PYTHONPATH folder), which may hold the service's data directory. The packages come
    # from the site-packages above or, installed editable, from their source folders only.
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
    # The (uid, gid) the run's processes take (run_user(): None keeps the agent's).
    user: tuple[int, int] | None = field(default_factory=lambda: run_user())
    # Paths under ``writable`` the run may read but not own (inputs linked from the cache).
    not_given: Sequence[Path] = ()
    # False: a network namespace of the run's own, with only a loopback interface.
    network: bool = True
    # More host paths shown at a path of the sandbox's (a socket of the agent's): (host, inside).
    binds: Sequence[tuple[Path, str]] = ()

    def give_writable(self) -> None:
        """Hand the run's directory (and ``shared_shm``) to the run's user before it starts."""
        if self.user is None:
            return
        give_to(self.writable, *self.user, keep=[*self.not_given, *self.read_only])
        if self.shared_shm is not None:
            os.chown(self.shared_shm, *self.user, follow_symlinks=False)
        for path in self.read_only:
            # The node's caches unpack into private folders (mkdtemp: 0700): what a run is
            # given to read must be readable by its user.
            with contextlib.suppress(OSError):
                mode = os.stat(path, follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode) and mode & 0o055 != 0o055:
                    os.chmod(path, stat.S_IMODE(mode) | 0o055)

    def hidden_paths(self) -> list[Path]:
        """Everything never shown: ``hidden``, ``TORCHYARD_SANDBOX_HIDE``, both as given and resolved."""
        found: list[Path] = []
        for path in [*self.hidden, *hidden_from_environment()]:
            found += [Path(path).absolute(), Path(path).resolve()]
        return list(dict.fromkeys(found))

    def command(self, argv: Sequence[str], cwd: Path) -> list[str]:
        bwrap = _bwrap_path()
        assert bwrap is not None
        args = [bwrap, "--die-with-parent", "--unshare-pid", "--cap-drop", "ALL", *self._user_caps()]
        if not self.network:
            args.append("--unshare-net")
        args += system_binds()
        args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
        if self.shared_shm is not None:
            # The processes of one run (each in a sandbox of its own) share their /dev/shm.
            args += ["--bind", str(self.shared_shm), "/dev/shm"]
        else:
            args += ["--perms", "1777", "--tmpfs", "/dev/shm"]
        args += _parent_folders([*python_paths(), Path(self.writable), *self.read_only])
        # After the private /tmp and /dev/shm: a Python or source tree under /tmp (a checkout
        # there, an editable install) shows on top of them.
        for path in python_paths():
            args += ["--ro-bind", str(path), str(path)]
        if self.gpus:
            devices = [str(p) for p in Path("/dev").glob("nvidia[0-9]*")] + list(_GPU_DEVICES)
            for device in devices:
                args += ["--dev-bind-try", device, device]
        args += self._covers()
        args += ["--bind", str(self.writable), str(self.writable)]
        for path in self.read_only:
            if path.exists():
                args += ["--ro-bind", str(path), str(path)]
        for host, inside in self.binds:
            args += ["--bind", str(host), inside]
        args += ["--chdir", str(cwd), "--"]
        return args + self._as_user() + list(argv)

    def _covers(self) -> list[str]:
        """An empty folder over each hidden folder that lies under a path shown (a work or data
        directory inside the source tree or the environment), under the run's own folders
        bound after it."""
        shown = [*python_paths(), *(Path(f) for f in _SYSTEM)]
        args: list[str] = []
        for path in self.hidden_paths():
            if path.is_dir() and any(path.is_relative_to(p) for p in shown):
                args += ["--tmpfs", str(path)]
        return args

    def _user_caps(self) -> list[str]:
        """What bwrap keeps for its last steps (its --chdir into the run's folder, now the run
        user's) and for setpriv, the first command in the sandbox, which gives them all up."""
        if self.user is None:
            return []
        args: list[str] = []
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_READ_SEARCH"):
            args += ["--cap-add", cap]
        return args

    def _as_user(self) -> list[str]:
        if self.user is None:
            return []
        uid, gid = self.user
        setpriv = shutil.which("setpriv") or "setpriv"
        return [
            setpriv,
            f"--reuid={uid}",
            f"--regid={gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]


# Folders the sandbox makes itself, which need no parents made for them.
_MADE = ("/", "/tmp", "/dev", "/dev/shm", "/proc")


def _parent_folders(binds: Iterable[Path]) -> list[str]:
    """``--dir`` for the folders on the way to each bound path that nothing else makes,
    readable by all (bwrap makes them 0700, through which a run's unprivileged user could
    not reach what is bound inside)."""
    covered = [Path(f) for f in _SYSTEM]
    bound = [Path(b) for b in binds]
    parents: set[Path] = set()
    for path in bound:
        for parent in path.parents:
            if str(parent) in _MADE or any(parent.is_relative_to(c) for c in covered):
                continue
            if any(parent != b and parent.is_relative_to(b) for b in bound):
                continue
            if parent in bound:
                continue
            parents.add(parent)
    args: list[str] = []
    for parent in sorted(parents, key=lambda p: (len(p.parts), str(p))):
        args += ["--perms", "0755", "--dir", str(parent)]
    return args


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
