"""Script jobs (docs/script-jobs.md): a plain DDP script run as a torchyard script job against the
same script under a bare torchrun on the same machine, interleaved in one run, and the
time from submission to the script's first line of output.

Usage::

    python bench/bench_script_jobs.py                 # 3 rounds, 2 processes, 60 timed steps
    python bench/bench_script_jobs.py --rounds 5 --steps 120 --nproc 2

Each round runs the bare torchrun and the job (a per_process script job on one agent
with ``--nproc`` CPU slots, SQLite, uvicorn in this process), the job first in every
other round. images/s is the
script's own figure (all ranks, after a warm-up); "submit -> first line" is the wall
time from the POST /v1/jobs answer to the time rank 0 printed its first line (before
it imports torch), read from its log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from service.api.app import create_app
from service.config import Settings

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "script_job" / "ddp_synthetic.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def api_server(settings: Settings) -> Iterator[str]:
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def bare_torchrun(args: argparse.Namespace, tmp: Path) -> float:
    result = tmp / f"bare-{time.monotonic_ns()}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        str(SCRIPT), "--steps", str(args.steps), "--batch_size", str(args.batch_size), "--result", str(result),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    speed: float = json.loads(result.read_text())["images_per_sec"]
    return speed


def job_run(client: httpx.Client, code: str, args: argparse.Namespace) -> tuple[float, float]:
    body = {
        "type": "script",
        "name": "bench-ddp",
        "code": code,
        "command": [
            "python",
            "ddp_synthetic.py",
            "--steps",
            str(args.steps),
            "--batch_size",
            str(args.batch_size),
        ],
        "resources": {"node_count": 1, "process_count_per_node": args.nproc},
    }
    r = client.post("/v1/jobs", json=body)
    r.raise_for_status()
    submitted = time.time()
    job_id = r.json()["id"]
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(2.0)  # rare polls: the bench must not take CPU from the job it times
    if job["status"] != "succeeded":
        raise RuntimeError(f"bench job failed: {job['failure']}")
    result = client.get(f"/v1/jobs/{job_id}/outputs", params={"path": "result.json"})
    result.raise_for_status()
    log = client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text
    first = float(re.search(r"first-line (\d+\.\d+)", log).group(1))  # type: ignore[union-attr]
    return float(result.json()["images_per_sec"]), first - submitted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-script-jobs-") as tmp_name:
        tmp = Path(tmp_name)
        settings = Settings(data_dir=tmp / "data", heartbeat_interval_s=1.0, lease_timeout_s=30.0)
        with api_server(settings) as url:
            admin = httpx.Client(
                base_url=url,
                headers={"Authorization": f"Bearer {settings.admin_token_path.read_text().strip()}"},
                timeout=60,
            )
            token = admin.post("/v1/tokens", json={"name": "bench-worker", "role": "worker"}).json()["token"]
            agent = subprocess.Popen(
                [sys.executable, "-m", "torchyard.cli", "worker", "--api", url, "--name", "bench", "--slots",
                 str(args.nproc), "--cpu", "--work-dir", str(tmp / "worker")],
                env={**os.environ, "TORCHYARD_TOKEN": token}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                archive = tmp / "code.tar.gz"
                with tarfile.open(archive, "w:gz") as tf:
                    tf.add(SCRIPT, arcname=SCRIPT.name)
                with open(archive, "rb") as fh:
                    code = admin.post("/v1/code", files={"file": ("code.tar.gz", fh)}).json()["id"]
                bare, job, first = [], [], []
                for i in range(args.rounds):
                    # Alternate which runs first, so a drift of the machine's speed
                    # (turbo, another tenant) does not favour one side.
                    if i % 2:
                        speed, latency = job_run(admin, code, args)
                        bare.append(bare_torchrun(args, tmp))
                    else:
                        bare.append(bare_torchrun(args, tmp))
                        speed, latency = job_run(admin, code, args)
                    job.append(speed)
                    first.append(latency)
                    print(f"round {i + 1}: bare torchrun {bare[-1]:.1f} img/s, script job {speed:.1f} img/s, "
                          f"submit -> first line {latency:.2f} s", flush=True)  # fmt: skip
            finally:
                agent.terminate()
                agent.wait(30)
    ratio = statistics.median(job) / statistics.median(bare)
    paired = statistics.median(j / b for j, b in zip(job, bare, strict=True))
    print(f"bare torchrun: median {statistics.median(bare):.1f} img/s ({args.nproc} processes)")
    print(f"script job:    median {statistics.median(job):.1f} img/s")
    print(f"job / bare:    {ratio:.3f} (ratio of the medians); {paired:.3f} (median of the rounds' ratios)")
    print(f"submit -> first line of stdout: median {statistics.median(first):.2f} s, max {max(first):.2f} s "
          "(the first round includes fetching the code to the node)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
