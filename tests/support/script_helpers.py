"""Helpers for script-job tests: code packages built from strings, a live API with real
agents, and a probe script that reports what each process sees."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import tarfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service.config import Settings
from tests.conftest import LiveServer
from tests.support.factories import auth
from tests.support.worker_fixtures import (
    AgentProcess,
    start_agent,
    user_client,
    wait_for_job,
    wait_for_node,
    worker_token,
)

# What every process of a probe job reports: its launch variables, whether it sees the
# worker token, the variable names in the environment of each of its ancestors it can
# read (``/proc/<pid>/environ``: pid -> names, None where refused), its input, and a gloo
# all-reduce over the world (proof the variables work). With PROBE_LATE_RANK set, that
# rank writes ``late.txt`` to its outputs PROBE_LATE_S seconds after the others ended.
PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    import torch.distributed as dist
    from torchyard import run

    def ancestors():
        found, pid = {}, os.getppid()
        while pid > 1:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    entries = f.read().split(b"\\0")
                found[str(pid)] = [e.split(b"=", 1)[0].decode(errors="replace") for e in entries if e]
            except OSError:
                found[str(pid)] = None
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        return found

    keys = ["MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "NNODES", "NPROC_PER_NODE", "TORCHYARD_OUTPUT_DIR",
            "TORCHYARD_LOG_DIR", "TORCHYARD_METRICS_FILE", "TORCHYARD_INPUT_DATA", "GREETING"]
    seen = {k: os.environ.get(k) for k in keys}
    # The job's own MLflow token (docs/script-jobs.md) is not the worker's: any other TOKEN would be.
    seen["token_visible"] = any("TOKEN" in k for k in os.environ if k != "MLFLOW_TRACKING_TOKEN")
    seen["mlflow_token"] = os.environ.get("MLFLOW_TRACKING_TOKEN")
    seen["ancestors"] = ancestors()
    seen["argv"] = sys.argv[1:]
    seen["cwd"] = os.getcwd()
    seen["pid"] = os.getpid()
    rank = int(os.environ["RANK"])
    print(f"hello from rank {rank}", flush=True)
    dist.init_process_group("gloo")
    import torch
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    seen["all_reduce"] = total.item()
    run.log_metric("probe.rank", rank, step=0)
    run.log_metric("probe.auto", 1.5)
    run.log_metric("probe.auto", 2.5)
    (run.output_dir() / f"rank-{rank}.json").write_text(json.dumps(seen))
    (run.log_dir() / f"rank-{rank}.txt").write_text(f"extra log of rank {rank}")
    if rank == 0:
        (run.log_dir() / "sub").mkdir(exist_ok=True)
        (run.log_dir() / "sub" / "notes.log").write_text("ünïcode notes", encoding="utf-8")
        (run.log_dir() / "weights.bin").write_bytes(b"\\x00\\x01binary")  # not text: not shipped
    dist.barrier()
    dist.destroy_process_group()
    if os.environ.get("PROBE_LATE_RANK") == str(rank):
        time.sleep(float(os.environ.get("PROBE_LATE_S", "5")))
        (run.output_dir() / "late.txt").write_text(f"rank {rank}, after the others ended")
    """
)


SECRET_NAMES = ("TORCHYARD_TOKEN", "TORCHYARD_DATABASE_URL")


def secrets_up_to_agent(seen: dict[str, Any], agent_pid: int) -> list[str]:
    """``pid:NAME`` for each secret variable a probe process found in the environment of one
    of its ancestors, up to and including the agent (which must be one of them)."""
    chain = [(int(pid), names) for pid, names in seen["ancestors"].items()]
    pids = [pid for pid, _ in chain]
    if seen.get("pid", 0) < 10 and agent_pid not in pids:
        below_agent = chain  # in the sandbox's PID namespace: nothing outside it is visible
    else:
        assert agent_pid in pids, (agent_pid, chain)
        below_agent = chain[: pids.index(agent_pid) + 1]
    return [f"{pid}:{name}" for pid, names in below_agent for name in names or () if name in SECRET_NAMES]


def code_archive(files: dict[str, str | bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in sorted(files.items()):
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


@dataclass
class ScriptEnv:
    server: LiveServer
    user: httpx.Client
    token: str
    tmp: Path
    agents: list[AgentProcess] = field(default_factory=list)

    def agent(self, name: str, *, slots: int, **kw: Any) -> AgentProcess:
        agent = start_agent(self.server.url, self.token, name, self.tmp / name, slots=slots, **kw)
        self.agents.append(agent)
        try:
            wait_for_node(self.user, name, timeout=120)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{agent.log_text()[-4000:]}") from None
        return agent

    def upload_code(self, files: dict[str, str | bytes], name: str = "probe") -> str:
        r = self.user.post(
            "/v1/code",
            data={"name": name},
            files={"file": ("src.tar.gz", code_archive(files), "application/gzip")},
        )
        assert r.status_code == 201, r.text
        code_id: str = r.json()["id"]
        return code_id

    def submit(self, code: str, command: list[str], **spec: Any) -> str:
        body = {"type": "script", "code": code, "command": command, **spec}
        r = self.user.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        return job_id

    def wait(self, job_id: str, predicate: Any = None, timeout: float = 180) -> dict[str, Any]:
        if predicate is None:
            return wait_for_job(self.user, job_id, timeout=timeout, agents=self.agents)
        return wait_for_job(self.user, job_id, predicate, timeout=timeout, agents=self.agents)

    def log(self, job_id: str, **params: Any) -> str:
        r = self.user.get(f"/v1/jobs/{job_id}/logs", params=params)
        assert r.status_code == 200, r.text
        return r.text

    def outputs(self, job_id: str) -> dict[str, bytes]:
        r = self.user.get(f"/v1/jobs/{job_id}/outputs")
        assert r.status_code == 200, r.text
        assert r.headers["etag"].strip('"') == hashlib.sha256(r.content).hexdigest()
        with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tf:
            return {m.name: tf.extractfile(m).read() for m in tf if m.isreg()}  # type: ignore[union-attr]

    def seen(self, job_id: str) -> dict[int, dict[str, Any]]:
        """What each process of a probe job reported, by rank."""
        files = self.outputs(job_id)
        found = {}
        for name, data in files.items():
            base = name.rsplit("/", 1)[-1]
            if base.startswith("rank-") and base.endswith(".json"):
                found[int(base[5:-5])] = json.loads(data)
        return found


@contextlib.contextmanager
def script_env(settings: Settings, tmp_path: Path, host: str = "127.0.0.1") -> Iterator[ScriptEnv]:
    server = LiveServer(settings, host=host).start()
    admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=60)
    user = user_client(admin, server.url)
    env = ScriptEnv(server, user, worker_token(admin), tmp_path)
    try:
        yield env
    finally:
        for agent in env.agents:
            agent.discard()
        user.close()
        admin.close()
        server.stop()
