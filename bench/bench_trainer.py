"""Training throughput of a torchyard job against a plain torchrun DDP script doing the same work (bench/RESULTS.md).

Writes the scikit-learn digits as an ImageDirectory, then compares, with the same
process count, batch size, image size, model, learning rate, augmentation ("light")
and epochs:

* the baseline, ``bench/plain_torchrun.py`` under torchrun, with
* ``--mode job`` (the default): a real torchyard job. The bench starts
  ``torchyard serve`` (SQLite in a temporary data directory) and one
  ``torchyard worker`` with ``--slots`` = nproc as child processes, uploads the
  digits through ``POST /v1/datasets``, submits the job (``process_count_per_node``
  = nproc) through ``POST /v1/jobs``, waits for ``succeeded`` and reads the
  ``train.images_per_sec`` points from ``GET /v1/jobs/{id}/metrics``. So the job's
  figure includes everything a job pays while it trains: the agent, its heartbeats
  and reports, the API storing them. Also shown: the queue time (queued → running
  in the job's history; the first job's includes the agent fetching the datasets)
  and the job's wall time (queued → succeeded) beside the plain script's (torchrun
  start → exit).
* ``--mode direct``: the trainer (``-m worker.trainer``) under torchrun, on a
  job.json as the worker agent writes it, without the service.

The images/sec of a run is the mean, over the epochs after the first (the first
includes start-up), of the epoch-end figure: all ranks' images over the epoch's
training time. The plain script prints it; for the trainer it is the
``train.images_per_sec`` point logged at the end of each epoch (the one at the step
of the epoch's ``val.loss``), from the job's metrics or, direct, its
``events.jsonl``. With ``--repeats N`` the baseline and the torchyard run alternate
N times, which evens out a noisy machine; the table shows each round and the
medians.

A job's ranks get OMP_NUM_THREADS = usable CPUs / nproc and the trainer's default
number of loader workers from the agent; in job mode the baseline gets the same
(``--threads`` and ``--workers`` must agree with them or be left out).

Every child (API, agent, torchrun and its ranks) is stopped at the end, also on
Ctrl-C or SIGTERM; the bench then checks that none of them is left.

Usage::

    python bench/bench_trainer.py                       # job mode, nproc 2, 3 epochs, resnet18 at 32 px
    python bench/bench_trainer.py --repeats 2
    python bench/bench_trainer.py --mode direct --nproc 4 --epochs 5 --batch-size 64
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from torchyard.sample_data import write_digits, write_photos
from worker.agent.node import usable_cpus

REPO = Path(__file__).resolve().parents[1]
# Set in the environment of every child, inherited by torchrun's ranks (also through
# the agent): what the final check looks for in the process table.
TAG_VAR = "TORCHYARD_BENCH_TAG"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 3600.0
_PR_SET_PDEATHSIG = 1


# --- child processes ---------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the bench dies without stopping it (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(command: list[str], env: Mapping[str, str], **kwargs: Any) -> subprocess.Popen[Any]:
    """A child in a session of its own (Ctrl-C reaches the bench only, which stops it in order)."""
    return subprocess.Popen(
        command,
        env=dict(env),
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        **kwargs,
    )


def _stop(process: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the child (torchrun and the agent stop their ranks), wait; past ``timeout``,
    SIGKILL its whole process group (its own: the child leads it and is not reaped yet)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _run(command: list[str], env: Mapping[str, str]) -> tuple[int, str, str, float]:
    """Run to the end: exit status, stdout, stderr, seconds. Interrupted, the group is stopped."""
    started = time.perf_counter()
    process = _spawn(command, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate()
    except BaseException:
        _stop(process, 20)
        raise
    return process.returncode, out, err, time.perf_counter() - started


def _tagged(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of live processes whose environment carries this run's tag."""
    needle = f"{TAG_VAR}={tag}\0".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                environ = fh.read() + b"\0"
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[-1].split()[0]
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        if state != b"Z" and (environ.startswith(needle) or b"\0" + needle in environ):
            found.append((int(entry.name), cmdline))
    return found


def _check_none_left(tag: str) -> None:
    """Every child and grandchild of this run must be gone; kill (by pid) and report any that is not."""
    deadline = time.monotonic() + 20
    left = _tagged(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _tagged(tag)
    if not left:
        print("no child process left running", flush=True)
        return
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    listing = "\n".join(f"  {pid} {cmd[:160]}" for pid, cmd in left)
    sys.exit(f"processes still running after the bench (killed now):\n{listing}")


def _cpu_seconds(pids: Iterable[int]) -> float:
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[-1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _wait_idle(pids: list[int], timeout: float = 90.0) -> None:
    """Until the service's processes use under 5 % of a core for two seconds in a row
    (the agent warms its imports after registering): no head start for either run."""
    deadline = time.monotonic() + timeout
    quiet, last = 0, _cpu_seconds(pids)
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(1.0)
        now = _cpu_seconds(pids)
        quiet = quiet + 1 if now - last < 0.05 else 0
        last = now


# Set by --gpu-decode for the trainer's ranks (the agent passes it on).
GPU_DECODE: dict[str, str] = {}


def _child_env(tag: str, **extra: str) -> dict[str, str]:
    """The bench's environment without TORCHYARD_* settings, with the run's tag."""
    # TORCHYARD_SANDBOX=off is kept: the agent then runs the ranks without their sandbox.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_") or k == "TORCHYARD_SANDBOX"}
    env.update(GPU_DECODE)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env[TAG_VAR] = tag
    env.update(extra)
    return env


# --- the two torchrun runs ---------------------------------------------------------------------


def _torchrun(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    env = _child_env(args.tag, OMP_NUM_THREADS=str(args.threads))
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
    ], env


def run_plain(args: argparse.Namespace, data: Path) -> tuple[float, float]:
    """The baseline's images/sec and wall seconds."""
    command, env = _torchrun(args)
    command += [
        str(REPO / "bench" / "plain_torchrun.py"),
        "--data",
        str(data),
        "--arch",
        args.arch,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--image-size",
        str(args.image_size),
        "--lr",
        str(args.lr),
        "--workers",
        str(args.workers),
    ]
    code, out, err, seconds = _run(command, env)
    rate = None
    for line in out.splitlines():
        if line.startswith("plain images/sec: "):
            rate = float(line.split(": ", 1)[1])
    if code != 0 or rate is None:
        sys.exit(f"plain script failed ({code}):\n{out[-3000:]}\n{err[-3000:]}")
    return rate, seconds


def _parameters(args: argparse.Namespace) -> dict[str, Any]:
    """The job parameters of the work plain_torchrun.py does."""
    return {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "warmup_epochs": 0,
        "learning_rate": args.lr,
        "random_seed": 1,
        "patience": args.epochs,  # no early stop: every run trains all epochs
        "print_frequency": 50,
        "image_size": args.image_size,
        "augmentation": "light",
    }


def steady_rate(points: Iterable[Mapping[str, Any]]) -> float:
    """Mean epoch-end ``train.images_per_sec`` over the epochs after the first.

    ``points`` are metric points (name, value, epoch, step) of one run; the epoch-end
    rate is the one logged at the step of the epoch's ``val.loss``."""
    points = list(points)
    epoch_end = {(p["epoch"], p["step"]) for p in points if p["name"] == "val.loss"}
    rates = [
        float(p["value"])
        for p in sorted(points, key=lambda p: (p["epoch"], p["step"]))
        if p["name"] == "train.images_per_sec" and (p["epoch"], p["step"]) in epoch_end
    ]
    if not rates:
        raise ValueError("no epoch-end train.images_per_sec point")
    steady = rates[1:] or rates
    return sum(steady) / len(steady)


def run_direct(args: argparse.Namespace, data: Path, run_dir: Path) -> tuple[float, float]:
    """The trainer under torchrun without the service: images/sec and wall seconds."""
    run_dir.mkdir(parents=True)
    classes = sorted(p.name for p in (data / "train").iterdir())
    job = {
        "job_id": "bench",
        "attempt_id": run_dir.name,
        "model": {"architecture": args.arch, "pretrained": False, "memory_efficient": False},
        "init_from_dir": None,
        "parameters": _parameters(args),
        "train_dir": str(data / "train"),
        "val_dir": str(data / "val"),
        "classes": classes,
        "datasets": None,
        "output_dir": str(run_dir),
        "loader_workers": args.workers,
    }
    (run_dir / "job.json").write_text(json.dumps(job))
    command, env = _torchrun(args)
    command += ["-m", "worker.trainer", "--config", str(run_dir / "job.json")]
    code, out, err, seconds = _run(command, env)
    if code != 0:
        sys.exit(f"trainer failed ({code}):\n{out[-3000:]}\n{err[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return steady_rate(e for e in events if e.get("name") in ("val.loss", "train.images_per_sec")), seconds


# --- the service -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _when(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


@dataclass
class JobRun:
    rate: float  # images/sec, as steady_rate
    queue_s: float  # queued -> running
    wall_s: float  # queued -> succeeded


class Service:
    """``torchyard serve`` and one ``torchyard worker``, child processes on a temporary data dir."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.root = root
        self.args = args
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = root / "service"
        self.api_log = root / "serve.log"
        self.agent_log = root / "agent.log"
        self.api: subprocess.Popen[Any] | None = None
        self.agent: subprocess.Popen[Any] | None = None
        self.client: httpx.Client | None = None

    # life cycle

    def start(self) -> None:
        env = _child_env(self.args.tag, TORCHYARD_DATA_DIR=str(self.data_dir))
        command = [sys.executable, "-m", "torchyard.cli", "serve", "--port", str(self.port)]
        with open(self.api_log, "ab") as log:
            self.api = _spawn(command, env, stdout=log, stderr=subprocess.STDOUT)
        token_file = self.data_dir / "admin.token"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._check_alive()
            if token_file.is_file():
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API did not answer within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=120)
        worker_token = self._json("POST", "/v1/tokens", json={"name": "bench-agent", "role": "worker"})[
            "token"
        ]
        command = [
            sys.executable,
            "-m",
            "torchyard.cli",
            "worker",
            "--api",
            self.url,
            "--name",
            "bench-node",
            "--slots",
            str(self.args.nproc),
            "--work-dir",
            str(self.root / "worker"),
        ]
        # The token in the environment, not on the command line (``ps`` shows that).
        env = _child_env(self.args.tag, TORCHYARD_TOKEN=worker_token)
        with open(self.agent_log, "ab") as log:
            self.agent = _spawn(command, env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            self._check_alive()
            nodes = self._json("GET", "/v1/cluster")["nodes"]
            if any(n["name"] == "bench-node" and n["status"] == "ready" for n in nodes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker agent did not register within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """The agent first (it stops its ranks, the API still answers its last reports), then the API."""
        if self.client is not None:
            self.client.close()
        for process in (self.agent, self.api):
            if process is not None:
                _stop(process)

    def pids(self) -> list[int]:
        return [p.pid for p in (self.api, self.agent) if p is not None]

    def _check_alive(self) -> None:
        for what, process, log in (("API", self.api, self.api_log), ("agent", self.agent, self.agent_log)):
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the {what} exited with status {process.returncode}:\n{_tail(log)}")

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        assert self.client is not None
        r = self.client.request(method, path, **kwargs)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:2000]}")
        return r.json()

    # the API

    def upload(self, folder: Path, name: str) -> str:
        """An image folder as a .tar.gz through ``POST /v1/datasets``; the dataset's id."""
        archive = self.root / f"{name}.tar.gz"
        with tarfile.open(archive, "w:gz") as tf:
            for path in sorted(folder.rglob("*")):
                tf.add(path, arcname=str(path.relative_to(folder)), recursive=False)
        with open(archive, "rb") as fh:
            body = self._json("POST", "/v1/datasets", data={"name": name}, files={"file": (archive.name, fh)})
        dataset_id: str = body["id"]
        return dataset_id

    def run_job(self, name: str, train: str, val: str) -> JobRun:
        args = self.args
        spec = {
            "name": name,
            "model": {"architecture": args.arch, "pretrained": False},
            "train_dataset": train,
            "validation_dataset": val,
            "parameters": _parameters(args),
            "resources": {"node_count": 1, "process_count_per_node": args.nproc},
        }
        job_id = self._json("POST", "/v1/jobs", json=spec)["id"]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while True:
            job = self._json("GET", f"/v1/jobs/{job_id}")
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} is {job['status']} after {JOB_TIMEOUT_S:.0f} s")
            time.sleep(1.0)
        if job["status"] != "succeeded":
            log = self.client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text if self.client else ""
            raise RuntimeError(
                f"job {job_id} {job['status']}: {job.get('failure')}\nrank 0 log ends with:\n"
                + "\n".join(log.splitlines()[-30:])
            )
        at = {h["status"]: _when(h["at"]) for h in job["history"]}
        points = list(self._metrics(job_id, ("train.images_per_sec", "val.loss")))
        return JobRun(steady_rate(points), at["running"] - at["queued"], at["succeeded"] - at["queued"])

    def _metrics(self, job_id: str, names: tuple[str, ...]) -> Iterator[dict[str, Any]]:
        after = 0
        while True:
            page = self._json(
                "GET",
                f"/v1/jobs/{job_id}/metrics",
                params={"name": list(names), "after": after, "limit": 10000},
            )
            yield from page["items"]
            if not page["items"] or page["next_after"] in (None, after):
                return
            after = page["next_after"]


# --- main --------------------------------------------------------------------------------------


def _job_mode_settings(args: argparse.Namespace) -> None:
    """Threads and loader workers of the baseline: what the agent and the trainer give a job's ranks."""
    import torch

    from worker.trainer.data import default_loader_workers

    agent_threads = max(1, usable_cpus() // args.nproc)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    agent_workers = default_loader_workers(device, args.nproc)
    if args.threads not in (None, agent_threads):
        sys.exit(f"--mode job: a job's ranks get {agent_threads} threads each; leave --threads out")
    if args.workers not in (None, agent_workers):
        sys.exit(f"--mode job: a job's ranks get {agent_workers} loader workers each; leave --workers out")
    args.threads, args.workers = agent_threads, agent_workers


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = zip(row, widths, strict=True)
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(cells)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mode",
        choices=["job", "direct"],
        default="job",
        help="job: a real job through the API and a worker agent (default); direct: the trainer under torchrun",
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=None, help="OMP threads per rank (default: usable cpus / nproc)"
    )
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="loader workers per rank, both runs (default: the trainer's default in job mode, 0 direct)",
    )
    parser.add_argument(
        "--data",
        choices=["digits", "photos"],
        default="digits",
        help="digits: the PNG digits; photos: photo-sized JPEGs (torchyard.sample_data.write_photos)",
    )
    parser.add_argument(
        "--per-class",
        type=int,
        default=None,
        help="digits: cap per class (default: all); photos: training images per class (default 300)",
    )
    parser.add_argument(
        "--gpu-decode",
        choices=["auto", "off"],
        default="auto",
        help="the trainer's TORCHYARD_GPU_DECODE (JPEG decoding on the GPU; default auto)",
    )
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.nproc < 1 or args.repeats < 1:
        parser.error("--nproc and --repeats must be at least 1")
    if args.mode == "job":
        _job_mode_settings(args)
    else:
        args.threads = args.threads or max(1, usable_cpus() // args.nproc)
        args.workers = 0 if args.workers is None else args.workers
    args.tag = uuid.uuid4().hex
    if args.gpu_decode == "off":
        GPU_DECODE["TORCHYARD_GPU_DECODE"] = "off"

    def terminate(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    started = time.perf_counter()
    interrupted = False
    try:
        with tempfile.TemporaryDirectory(prefix="torchyard-bench-") as tmp:
            _bench(args, Path(tmp))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        _check_none_left(args.tag)
    if interrupted:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    print(f"bench wall time {time.perf_counter() - started:.0f} s", flush=True)


def _bench(args: argparse.Namespace, root: Path) -> None:
    digits = root / args.data
    if args.data == "photos":
        train_dir, val_dir = write_photos(
            digits, train_per_class=args.per_class or 300, val_per_class=50, workers=usable_cpus()
        )
    else:
        train_dir, val_dir = write_digits(digits, per_class=args.per_class, size=args.image_size)
    n_train = sum(1 for p in train_dir.rglob("*") if p.is_file())
    print(
        f"{args.arch} at {args.image_size} px, batch {args.batch_size}/process, {args.nproc} processes x "
        f"{args.threads} threads, {args.workers} loader workers, {args.epochs} epochs of {n_train} images, "
        f"mode {args.mode}, {args.data}, GPU decoding {args.gpu_decode}",
        flush=True,
    )
    service = Service(root, args) if args.mode == "job" else None
    plain: list[float] = []
    ours: list[float] = []
    rows: list[list[str]] = []
    try:
        if service is not None:
            service.start()
            train_id = service.upload(train_dir, f"{args.data}-train")
            val_id = service.upload(val_dir, f"{args.data}-val")
            print(
                f"API at {service.url}, worker agent ready with {args.nproc} slots, {args.data} uploaded",
                flush=True,
            )
        for i in range(args.repeats):
            if service is not None:
                _wait_idle(service.pids())
            rate, plain_wall = run_plain(args, digits)
            plain.append(rate)
            if service is not None:
                _wait_idle(service.pids())
                job = service.run_job(f"bench-{i + 1}", train_id, val_id)
                ours.append(job.rate)
                row = [f"round {i + 1}", f"{rate:.1f}", f"{job.rate:.1f}", f"{job.rate / rate:.3f}"]
                row += [f"{job.queue_s:.2f}", f"{plain_wall:.1f}", f"{job.wall_s:.1f}"]
            else:
                direct, direct_wall = run_direct(args, digits, root / f"run-{i}")
                ours.append(direct)
                row = [f"round {i + 1}", f"{rate:.1f}", f"{direct:.1f}", f"{direct / rate:.3f}"]
                row += [f"{plain_wall:.1f}", f"{direct_wall:.1f}"]
            rows.append(row)
            print("  " + "  ".join(row), flush=True)
    finally:
        if service is not None:
            service.stop()
    p, t = statistics.median(plain), statistics.median(ours)
    median = ["median", f"{p:.1f}", f"{t:.1f}", f"{t / p:.3f}"]
    if args.mode == "job":
        header = ["", "plain img/s", "job img/s", "job/plain", "queue s", "plain wall s", "job wall s"]
        queues = [float(r[4]) for r in rows]
        median += [f"{statistics.median(queues):.2f}", "", ""]
    else:
        header = ["", "plain img/s", "trainer img/s", "trainer/plain", "plain wall s", "trainer wall s"]
        median += ["", ""]
    print()
    _table([*rows, median] if len(rows) > 1 else rows, header)


if __name__ == "__main__":
    main()
