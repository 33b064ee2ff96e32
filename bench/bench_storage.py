"""What the API process spends on artifacts' bytes: the data directory against an S3 bucket
(docs/storage.md).

``python bench/bench_storage.py`` starts ``torchyard serve`` as a process of its own (SQLite,
one API process, so ``/proc/<pid>`` is the API alone) twice: with file storage
(``TORCHYARD_STORAGE_URL`` unset) and with a bucket of a real S3 server (SeaweedFS's
``weed mini`` on loopback, ``tests/support/s3_server.py``; the API gets
``TORCHYARD_STORAGE_URL=s3://<bucket>/bench`` and the server's AWS variables). Each time:

* **checkpoints up**: ``--checkpoints`` checkpoints of ``--gb`` GiB in all (4 × 256 MiB by
  default; random bytes, each different) uploaded to a running job under its lease by the
  agent's code path: :func:`torchyard.apiclient.direct.upload` to
  ``POST /v1/worker/jobs/{id}/checkpoint/upload``, and when that answers that the API takes
  the bytes itself (file storage), ``PUT /v1/worker/jobs/{id}/checkpoint`` with the headers
  ``worker/agent/checkpoints.py`` sends;
* **checkpoints down**: the job's latest checkpoint fetched as many times by
  :func:`worker.agent.checkpoints.download_checkpoint` (redirects followed, sha256 checked,
  written and fsynced into a run directory);
* **model down**: a succeeded job's ``--model-gb`` GiB model archive (random bytes under the
  key ``models/<job id>.tar.gz``: a file of the data directory, or an object put into the
  bucket with boto3) downloaded from ``GET /v1/jobs/{id}/model`` with httpx following
  redirects, streamed to a file and hashed. Where that route does not answer a bucket's
  archive with a redirect (before object storage covered it), the row says so and the
  checkpoint download's throughput stands for the download figure.

Per row: wall time and MiB/s; and per GiB moved, the API process's CPU seconds (user +
system, ``/proc/<pid>/stat``), the bytes it read and wrote (``rchar`` + ``wchar`` of
``/proc/<pid>/io``), the ``api_artifact_bytes`` of ``GET /v1/storage`` (received + sent:
the artifact bytes on its sockets), the S3 server's CPU seconds, and this process's CPU
seconds (the agent's or user's side). ``rchar``/``wchar`` count ``read``/``write`` calls
and so files, not the sockets' traffic: asyncio (uvicorn) and boto3 use ``recv``/``send``,
which they leave out. Reading ``/proc/<pid>/io`` of ``serve`` (which makes itself
non-dumpable) needs root or CAP_SYS_PTRACE; without, that column reads "n/a".

The job's rows are written straight into the database (``tests/support/report_helpers.py``),
as a claim would leave them. Everything lives in one temporary folder under ``--dir``
(``/dev/shm`` by default, so that a disk does not set the pace; about 2 × ``--gb`` +
2 × ``--model-gb`` GiB at the most), removed at the end with the API and S3 server
processes, also when the bench fails or is interrupted.

Usage (from the repository root)::

    python bench/bench_storage.py [--gb 1] [--checkpoints 4] [--model-gb 1] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.config import Settings
from tests.support.api_process import ApiProcess
from tests.support.factories import auth
from tests.support.report_helpers import RunningJob, finish_job, start_running_job
from tests.support.s3_server import S3Server, s3_unavailable
from torchyard.apiclient import direct
from torchyard.contract.headers import (
    CHECKPOINT_EPOCH_HEADER,
    LEASE_HEADER,
    SHA256_HEADER,
)
from worker.agent.checkpoints import download_checkpoint

GIB = 1024**3
MIB = 1024**2
_CHUNK = 1 << 20
PREFIX = "bench"
_TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a running process, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _io_bytes(pid: int) -> int | None:
    """Bytes the process read and wrote (``rchar + wchar``), None where /proc refuses."""
    try:
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    except PermissionError:
        return None
    values = dict(line.split(": ", 1) for line in lines)
    return int(values["rchar"]) + int(values["wchar"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _random_file(path: Path, size: int, head: bytes = b"") -> None:
    """``size`` random bytes (``head`` first), written a MiB at a time."""
    with open(path, "wb") as fh:
        fh.write(head)
        left = size - len(head)
        while left > 0:
            n = min(_CHUNK, left)
            fh.write(os.urandom(n))
            left -= n


@dataclass
class Row:
    backend: str
    transfer: str
    size: int  # bytes moved
    seconds: float
    api_cpu: float
    api_io: int | None
    api_artifact: int
    weed_cpu: float | None
    client_cpu: float
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.note.startswith("HTTP")

    def cells(self) -> list[str]:
        gib = self.size / GIB

        def per(value: float) -> str:
            return "—" if self.failed else f"{value / gib:.2f}"

        return [
            self.backend,
            self.transfer,
            f"{gib:.2f}",
            f"{self.seconds:.2f}",
            "—" if self.failed else f"{self.size / MIB / self.seconds:.0f}",
            per(self.api_cpu),
            "n/a" if self.api_io is None else per(self.api_io / GIB),
            per(self.api_artifact / GIB),
            "—" if self.weed_cpu is None else per(self.weed_cpu),
            per(self.client_cpu),
        ]


HEADER = [
    "backend",
    "transfer",
    "GiB",
    "wall s",
    "MiB/s",
    "API CPU s/GiB",
    "API file read+write GiB/GiB",
    "api_artifact_bytes GiB/GiB",
    "S3 server CPU s/GiB",
    "client CPU s/GiB",
]


class Meter:
    """Counters of the API (and S3 server) process around one transfer."""

    def __init__(self, api_pid: int, admin: httpx.Client, weed_pid: int | None) -> None:
        self.api_pid = api_pid
        self.admin = admin
        self.weed_pid = weed_pid

    def _artifact_bytes(self) -> int:
        r = self.admin.get("/v1/storage")
        r.raise_for_status()
        moved = r.json().get("api_artifact_bytes", {})
        return int(moved.get("received", 0)) + int(moved.get("sent", 0))

    def measure(self, backend: str, transfer: str, size: int, work: Callable[[], str | None]) -> Row:
        """Run ``work`` (which returns a note or None) and the counters' differences."""
        artifact = self._artifact_bytes()
        io = _io_bytes(self.api_pid)
        cpu = _cpu_seconds(self.api_pid)
        weed = _cpu_seconds(self.weed_pid) if self.weed_pid else None
        client = time.process_time()
        started = time.perf_counter()
        note = work()
        seconds = time.perf_counter() - started
        client = time.process_time() - client
        cpu = _cpu_seconds(self.api_pid) - cpu
        io_after = _io_bytes(self.api_pid)
        weed = _cpu_seconds(self.weed_pid) - weed if self.weed_pid and weed is not None else None
        artifact = self._artifact_bytes() - artifact
        return Row(
            backend,
            transfer,
            size,
            seconds,
            cpu,
            None if io is None or io_after is None else io_after - io,
            artifact,
            weed,
            client,
            note or "",
        )


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            yield chunk


def upload_checkpoint(worker: httpx.Client, job: RunningJob, path: Path, sha256: str, epoch: int) -> None:
    """As the agent's uploader: a direct upload, else the PUT to the API."""
    headers = {LEASE_HEADER: job.lease, CHECKPOINT_EPOCH_HEADER: str(epoch)}
    url = f"/v1/worker/jobs/{job.job_id}/checkpoint"
    response = direct.upload(worker, f"{url}/upload", path, headers=headers, sha256=sha256)
    if response is None:
        response = worker.put(
            url,
            content=_chunks(path),
            headers={
                **headers,
                SHA256_HEADER: sha256,
                "Content-Length": str(path.stat().st_size),
                "Content-Type": "application/octet-stream",
            },
            timeout=_TIMEOUT,
        )
    if response.status_code >= 400:
        raise RuntimeError(f"checkpoint upload: HTTP {response.status_code}: {response.text[:500]}")


def download_model(user: httpx.Client, job_id: str, target: Path, sha256: str) -> tuple[bool, int]:
    """``GET /v1/jobs/{id}/model`` streamed to ``target`` and hashed: (redirected, status)."""
    digest = hashlib.sha256()
    with user.stream("GET", f"/v1/jobs/{job_id}/model", timeout=_TIMEOUT) as response:
        redirected = bool(response.history) and response.history[0].status_code in (302, 303, 307)
        if response.status_code != 200:
            response.read()
            return redirected, response.status_code
        with open(target, "wb") as fh:
            for chunk in response.iter_bytes(_CHUNK):
                digest.update(chunk)
                fh.write(chunk)
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"the model downloaded hashes to {digest.hexdigest()}, not {sha256}")
    return redirected, 200


def run_backend(
    backend: str,
    root: Path,
    checkpoints: list[tuple[Path, str]],
    model: tuple[Path, str],
    s3: S3Server | None,
) -> list[Row]:
    data_dir = root / f"data-{backend}"
    env: dict[str, str] = {}
    bucket = None
    if s3 is not None:
        bucket = s3.make_bucket()
        env = {"TORCHYARD_STORAGE_URL": f"s3://{bucket}/{PREFIX}", **s3.env()}
    api = ApiProcess(data_dir, None, settings=env, name=f"api-{backend}")
    rows: list[Row] = []
    try:
        api.start().wait_ready()
        assert api.proc is not None
        settings = Settings(data_dir=data_dir, database_url=None)  # the API's: SQLite in data_dir
        admin = httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=60)
        job = start_running_job(settings, admin, per_node=1)
        worker = httpx.Client(base_url=api.url, headers=auth(job.worker_token), timeout=_TIMEOUT)
        user = httpx.Client(
            base_url=api.url, headers=auth(job.user_token), timeout=_TIMEOUT, follow_redirects=True
        )
        meter = Meter(api.proc.pid, admin, s3.process.pid if s3 is not None and s3.process else None)
        total = sum(path.stat().st_size for path, _ in checkpoints)

        def up() -> None:
            for epoch, (path, sha256) in enumerate(checkpoints, start=1):
                upload_checkpoint(worker, job, path, sha256, epoch)

        rows.append(meter.measure(backend, "checkpoints up", total, up))
        run_dir = root / f"run-{backend}"
        run_dir.mkdir()

        def down() -> None:
            for _ in checkpoints:
                got = download_checkpoint(worker, job.job_id, job.lease, run_dir)
                assert got["sha256"] == checkpoints[-1][1], got
            (run_dir / "checkpoint.pt").unlink()

        rows.append(meter.measure(backend, "checkpoints down", total, down))
        rows.append(_model_row(backend, root, settings, admin, job, user, meter, model, s3, bucket))
        for client in (admin, worker, user):
            client.close()
    except BaseException:
        print(f"the API's log ({api.log_path.name}), its end:\n{api.log()[-3000:]}", file=sys.stderr)
        raise
    finally:
        api.terminate()
    return rows


def _model_row(
    backend: str,
    root: Path,
    settings: Settings,
    admin: httpx.Client,
    checkpoint_job: RunningJob,
    user: httpx.Client,
    meter: Meter,
    model: tuple[Path, str],
    s3: S3Server | None,
    bucket: str | None,
) -> Row:
    """A succeeded job of the same user whose archive is ``model``, downloaded once."""
    source, sha256 = model
    size = source.stat().st_size
    job = start_running_job(
        settings,
        admin,
        per_node=1,
        user_token=checkpoint_job.user_token,
        worker_token=checkpoint_job.worker_token,
    )
    key = f"models/{job.job_id}.tar.gz"
    if s3 is None:
        path = settings.data_dir / key
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, path)
        except OSError:
            shutil.copyfile(source, path)
    else:
        from boto3.s3.transfer import TransferConfig

        s3.client().upload_file(
            str(source), bucket, f"{PREFIX}/{key}", Config=TransferConfig(multipart_chunksize=64 * MIB)
        )
    _set_model(settings, job.job_id, sha256, size)
    finish_job(settings, job, "succeeded")
    target = root / f"model-{backend}.tar.gz"
    outcome: dict[str, Any] = {}

    def down() -> str | None:
        outcome["redirected"], outcome["status"] = download_model(user, job.job_id, target, sha256)
        target.unlink(missing_ok=True)
        if outcome["status"] != 200:
            return f"HTTP {outcome['status']}: the model route does not serve a bucket's archive yet"
        if s3 is not None and not outcome["redirected"]:
            return "answered by the API itself, not a redirect"
        return "redirect to the bucket" if outcome["redirected"] else ""

    return meter.measure(backend, "model down", size, down)


def _set_model(settings: Settings, job_id: str, sha256: str, size: int) -> None:
    from sqlalchemy import update

    from service.db.engine import Database
    from service.db.models import Job

    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(update(Job).where(Job.id == job_id).values(model_sha256=sha256, model_size=size))
    finally:
        db.dispose()


def _stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that the ``finally`` blocks stop what was started."""

    def raise_exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GiB of checkpoints uploaded (and downloaded)")
    parser.add_argument("--checkpoints", type=int, default=4, help="how many checkpoints those GiB are")
    parser.add_argument("--model-gb", type=float, default=1.0, help="GiB of the model archive downloaded")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where the temporary folder goes")
    parser.add_argument(
        "--backend", choices=("file", "s3", "both"), default="both", help="which storage to measure"
    )
    args = parser.parse_args()
    if args.backend != "file" and (reason := s3_unavailable()) is not None:
        parser.error(reason)
    _stop_on_sigterm()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    root = Path(tempfile.mkdtemp(prefix="torchyard-bench-storage-", dir=args.dir))
    rows: list[Row] = []
    try:
        size = int(args.gb * GIB) // args.checkpoints
        checkpoints = []
        for n in range(args.checkpoints):
            path = root / f"checkpoint-{n}.pt"
            _random_file(path, size)
            checkpoints.append((path, _sha256(path)))
        model_path = root / "model.tar.gz"
        _random_file(model_path, int(args.model_gb * GIB))
        model = (model_path, _sha256(model_path))
        print(
            f"{args.checkpoints} checkpoints of {size / MIB:.0f} MiB, a model archive of "
            f"{model_path.stat().st_size / MIB:.0f} MiB, under {args.dir}"
        )
        if args.backend in ("file", "both"):
            rows += run_backend("file", root, checkpoints, model, None)
        if args.backend in ("s3", "both"):
            s3 = S3Server(root / "s3")
            try:
                s3.start()
                rows += run_backend("s3", root, checkpoints, model, s3)
            finally:
                s3.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + " --- |" * len(HEADER))
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    for row in rows:
        if row.note:
            print(f"{row.backend}, {row.transfer}: {row.note}")
    by = {(row.backend, row.transfer): row for row in rows}
    s3_model = by.get(("s3", "model down"))
    if s3_model is not None and "redirect to the bucket" not in s3_model.note:
        fallback = by[("s3", "checkpoints down")]
        print(
            "the model route did not redirect to the bucket: the 1 GiB download figure with S3 is "
            f"the checkpoint download's, {fallback.size / MIB / fallback.seconds:.0f} MiB/s"
        )


if __name__ == "__main__":
    main()
