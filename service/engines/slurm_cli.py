"""Slurm's own commands, as the API's Unix user runs them, and what their output means.

Only the commands every Slurm installation has are used (``sinfo``, ``sbatch``,
``squeue``, ``scontrol``, ``scancel``); without slurmdbd there is no ``sacct``, so a
finished job is read from ``squeue -t all`` (kept ``MinJobAge`` seconds) and
``scontrol -o show job`` (one line, ``Key=Value`` words whose values may hold spaces).

Every ``squeue`` and ``scancel`` is limited to the Slurm user the API submits as (the
Unix user running it: ``-u <name>``, or ``--me`` where that user has no name here), and
the jobs read back are checked to be that user's (``%U``): a job another user of the
cluster submitted under a torchyard job's name is never adopted, polled or cancelled.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

COMMANDS = ("sinfo", "sbatch", "squeue", "scontrol", "scancel")
# Job states after which nothing of the job runs any more.
ENDED_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)
# A node in one of these (or any state marked ``*``: not responding) is lost to torchyard.
_LOST_NODE_STATES = ("down", "fail", "unk", "futr", "npc", "pow", "boot", "inval", "maint", "reboot")
_DRAIN_NODE_STATES = ("drain", "drng", "drained", "draining")


class SlurmCommandError(RuntimeError):
    """A Slurm command failed; ``output`` is what it said."""

    def __init__(self, argv: Sequence[str], code: int, output: str) -> None:
        super().__init__(f"{shlex.join(argv)} exited with {code}: {output.strip()[-2000:]}")
        self.code = code
        self.output = output


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None]


def user_name(uid: int) -> str | None:
    """The name of the Unix user ``uid`` on this machine, or None when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


@dataclass
class Slurm:
    """Runs Slurm's commands with a clean environment (``SLURM_CONF`` kept).

    ``uid``: the user Slurm knows the API's jobs by (the one running ``sbatch``: this
    process's); queries and cancels see that user's jobs only.
    """

    timeout_s: float = 30.0
    env: Mapping[str, str] = field(default_factory=lambda: _clean_env(os.environ))
    uid: int = field(default_factory=os.geteuid)

    @property
    def user_filter(self) -> list[str]:
        """``-u <name>``: the jobs of the user the API submits as (``--me`` for a nameless uid)."""
        name = user_name(self.uid)
        if name is None:
            return ["--me"]
        return ["-u", name]

    def owns(self, uid: str) -> bool:
        """Whether a job's ``%U`` (numeric user id) is the API's user."""
        return uid.strip() == str(self.uid)

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True) -> str:
        try:
            proc = subprocess.run(
                list(argv),
                env=dict(env if env is not None else self.env),
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except FileNotFoundError as exc:
            raise SlurmCommandError(argv, 127, f"{argv[0]}: command not found") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmCommandError(argv, 124, f"no answer within {self.timeout_s:g} s") from exc
        if check and proc.returncode != 0:
            raise SlurmCommandError(argv, proc.returncode, proc.stderr or proc.stdout)
        return proc.stdout

    # --- inventory ----------------------------------------------------------------------

    def nodes(self, partitions: Sequence[str]) -> list[SlurmNode]:
        """``sinfo -h -N -p P -o '%N|%t|%G|%c|%o|%P'``: one row per node (and partition)."""
        argv = ["sinfo", "-h", "-N", "-o", "%N|%t|%G|%c|%o|%P"]
        if partitions:
            argv += ["-p", ",".join(partitions)]
        return parse_sinfo(self.run(argv))

    def default_partition(self) -> str | None:
        for line in self.run(["sinfo", "-h", "-o", "%P"]).split():
            if line.endswith("*"):
                return line.rstrip("*")
        return None

    def partition_grace_s(self, partition: str) -> int | None:
        """A partition's preemption ``GraceTime`` in seconds (None when unknown)."""
        out = self.run(["scontrol", "-o", "show", "partition", partition], check=False)
        fields = parse_scontrol(out)
        value = fields.get("GraceTime")
        return int(value) if value is not None and value.isascii() and value.isdigit() else None

    # --- jobs ---------------------------------------------------------------------------

    def queue(self) -> dict[str, SlurmJob]:
        """``squeue -h -t all -u USER -o '%i|%j|%T|%r|%U|%N'``: every job of the API's user
        Slurm still remembers, by id."""
        jobs = {}
        argv = ["squeue", "-h", "-t", "all", *self.user_filter, "-o", "%i|%j|%T|%r|%U|%N"]
        for line in self.run(argv).splitlines():
            parts = line.strip().split("|", 5)
            if len(parts) == 6 and self.owns(parts[4]):
                job = SlurmJob(id=parts[0], name=parts[1], state=parts[2], reason=parts[3], nodes=parts[5])
                jobs[job.id] = job
        return jobs

    def job_ids_named(self, name: str) -> list[str]:
        """Ids of the API's user's jobs named ``name`` (any state Slurm still remembers)."""
        out = self.run(["squeue", "-h", "-t", "all", *self.user_filter, "-n", name, "-o", "%i|%T|%U"])
        rows = [line.split("|") for line in out.split() if line]
        return [row[0] for row in rows if len(row) == 3 and self.owns(row[2])]

    def show_job(self, job_id: str) -> dict[str, str]:
        """``scontrol -o show job ID`` as a dict (empty once Slurm forgot the job)."""
        return parse_scontrol(self.run(["scontrol", "-o", "show", "job", job_id], check=False))

    def submit(self, argv: Sequence[str], env: Mapping[str, str]) -> str:
        """``sbatch --parsable ...``: the new job's id."""
        out = self.run(["sbatch", "--parsable", *argv], env=env).strip()
        return out.split(";", 1)[0]

    def test_only(self, argv: Sequence[str]) -> str | None:
        """``sbatch --test-only``: None if Slurm could run the job, else its refusal."""
        try:
            self.run(["sbatch", "--test-only", *argv])
        except SlurmCommandError as exc:
            return exc.output.strip() or str(exc)
        return None

    def cancel(self, job_id: str) -> None:
        """``scancel -u USER ID``: never another user's job, whatever the id."""
        self.run(["scancel", *self.user_filter, job_id], check=False)


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str
    gpus: int
    cpus: int
    address: str
    partitions: tuple[str, ...]

    @property
    def units(self) -> int:
        """GPUs from the gres column, else CPUs."""
        return self.gpus if self.gpus > 0 else max(1, self.cpus)

    @property
    def status(self) -> str:
        """torchyard's node status for Slurm's state: ready, drained or lost."""
        state = self.state.lower()
        base = state.rstrip("*~#!%$@^-+")
        if state.endswith("*") or base.startswith(_LOST_NODE_STATES):
            return "lost"
        if base.startswith(_DRAIN_NODE_STATES):
            return "drained"
        return "ready"


@dataclass(frozen=True)
class SlurmJob:
    id: str
    name: str
    state: str
    reason: str
    nodes: str

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


def parse_gres_gpus(gres: str) -> int:
    """GPUs in a gres column (``gpu:2``, ``gpu:a100:4(S:0-1)``, ``gpu:1,gpu:v100:2``)."""
    return sum(int(m.group(1)) for m in _GRES_GPU.finditer(gres.replace(" ", "")))


def parse_sinfo(out: str) -> list[SlurmNode]:
    rows: dict[str, SlurmNode] = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 6:
            continue
        name, state, gres, cpus, address, partition = parts[:6]
        partition = partition.rstrip("*")
        known = rows.get(name)
        partitions = (*known.partitions, partition) if known else (partition,)
        rows[name] = SlurmNode(
            name=name,
            state=state,
            gpus=parse_gres_gpus(gres),
            cpus=int(cpus) if cpus.isascii() and cpus.isdigit() else 1,
            address=address or name,
            partitions=partitions,
        )
    return [rows[n] for n in sorted(rows)]


_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_scontrol(out: str) -> dict[str, str]:
    """One ``scontrol -o`` line as ``{key: value}``; a value runs up to the next `` Key=``."""
    line = out.strip().splitlines()[0] if out.strip() else ""
    matches = list(_SCONTROL_KEY.finditer(line))
    fields: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        fields[m.group(1)] = line[m.end() : end].strip()
    return fields


def _clean_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment Slurm's commands get: none of the API's secrets (sbatch exports its
    environment to the job)."""
    keep = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "SLURM_CONF")
    return {k: env[k] for k in keep if k in env}
