"""Each run in its sandbox (worker.agent.sandbox), attacked for real by a script job: it
looks for the admin token, the worker token, the database, the node key, another user's run
and a dataset it was not given, by absolute and relative paths, through ``/proc`` and
through symlinks, and finds none of them; a sleeper it double-forks into a new session with
an empty environment is gone once the job ends."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import fast_leases
from tests.support.factories import auth
from tests.support.sandbox_helpers import require_sandbox
from tests.support.script_helpers import ScriptEnv, script_env
from tests.support.worker_fixtures import processes_mentioning, upload_dataset, user_client, wait_until_gone

SETTINGS = fast_leases(lease_s=15.0, ports=(26500, 26999))

ATTACK = textwrap.dedent(
    """
    import json, os, sys

    targets = json.load(open("targets.json"))
    marker = sys.argv[1]
    found = []
    own = os.path.realpath(os.environ["TORCHYARD_OUTPUT_DIR"])

    def attempt(how, path):
        try:
            if os.path.isdir(path):
                # The folders on the way to its own run directory are all it may see.
                names = [n for n in os.listdir(path) if not own.startswith(os.path.join(os.path.realpath(path), n) + "/")]
                if names:
                    found.append(f"{how}: listed {path}: {names[:5]}")
                return
            with open(path, "rb") as fh:
                fh.read(1)
            found.append(f"{how}: read {path}")
        except OSError:
            pass

    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for name, target in targets.items():
        attempt(f"{name} absolute", target)
        attempt(f"{name} relative", os.path.relpath(target, os.getcwd()))
        attempt(f"{name} relative to the outputs", os.path.relpath(target, os.environ["TORCHYARD_OUTPUT_DIR"]))
        for pid in ["self", *pids]:
            attempt(f"{name} via /proc/{pid}/root", f"/proc/{pid}/root{target}")
            attempt(f"{name} via /proc/{pid}/cwd", f"/proc/{pid}/cwd/" + os.path.relpath(target, os.getcwd()))
        link = f"link-{name}"
        os.symlink(target, link)
        attempt(f"{name} via a symlink", link)
        attempt(f"{name} via a symlink in the outputs", os.path.join("outputs", "..", "..", "..", link))
    # Secrets in any environment it can read (the agent's token, the database URL).
    for pid in pids:
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        for secret in (b"TORCHYARD_TOKEN=", b"TORCHYARD_DATABASE_URL=", targets["agent_token_prefix"].encode()):
            if secret in environ:
                found.append(f"/proc/{pid}/environ holds {secret[:16]!r}")
    with open(os.path.join(os.environ["TORCHYARD_OUTPUT_DIR"], "found.json"), "w") as fh:
        json.dump({"found": found, "pids": len(pids)}, fh)

    # A sleeper that escapes every process-group and environment marker: double fork, new
    # session, empty environment.
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execve("/bin/sleep", ["sleep", "600", marker], {})
        os._exit(0)
    os.wait()
    print("sleeper started", flush=True)
    """
)

VICTIM = """
import os
open(os.path.join(os.environ["TORCHYARD_OUTPUT_DIR"], "secret.txt"), "w").write("bob's results")
"""


@pytest.fixture
def env(make_settings: Any, tmp_path: Path) -> Iterator[ScriptEnv]:
    require_sandbox()
    settings: Settings = make_settings(**SETTINGS)
    with script_env(settings, tmp_path) as e:
        yield e


def test_a_script_job_finds_no_secret_no_other_run_and_leaves_no_process(
    env: ScriptEnv, tmp_path: Path
) -> None:
    from torchyard.sample_data import write_digits

    agent = env.agent("boxed", slots=1)
    r = env.user.get("/v1/cluster")
    assert [n["sandbox"] for n in r.json()["nodes"]] == ["bwrap"]
    # Another user's job ran on the node first: its run directory and its dataset stay there.
    admin = httpx.Client(base_url=env.server.url, headers=auth(env.server.admin_token), timeout=60)
    bob = user_client(admin, env.server.url, name="bob")
    train_dir, val_dir = write_digits(tmp_path / "digits", per_class=2, size=16)
    bobs_data = upload_dataset(bob, val_dir, "bobs")
    bob_env = ScriptEnv(env.server, bob, env.token, tmp_path)
    victim = bob_env.submit(
        bob_env.upload_code({"v.py": VICTIM}), ["python", "v.py"], inputs={"d": bobs_data["id"]}
    )
    assert bob_env.wait(victim)["status"] == "succeeded"
    bobs_run = next((agent.work_dir / "runs").glob(f"{victim}-*"))
    bobs_cached = agent.work_dir / "datasets" / bobs_data["sha256"]
    assert bobs_cached.is_dir()
    data = upload_dataset(env.user, train_dir, "mine")

    settings = env.server.settings
    targets = {
        "admin_token": str(settings.admin_token_path),
        "data_dir": str(settings.data_dir),
        "node_key": str(next(agent.work_dir.glob("*.key"))),
        "work_dir": str(agent.work_dir),
        "bobs_run": str(bobs_run),
        "bobs_outputs": str(bobs_run / "outputs" / "secret.txt"),
        "bobs_dataset_in_cache": str(bobs_cached),
        "dataset_cache": str(agent.work_dir / "datasets"),
        "agent_token_prefix": env.token[:12],
    }
    database = settings.database_url
    if database.startswith("sqlite:///"):
        targets["database"] = database.removeprefix("sqlite:///")
    marker = "sandbox-sleeper-5e1d"
    code = env.upload_code({"attack.py": ATTACK, "targets.json": json.dumps(targets)})
    job_id = env.submit(code, ["python", "attack.py", marker], inputs={"data": data["id"]})
    job = env.wait(job_id)
    assert job["status"] == "succeeded", (job, env.log(job_id, rank=0))
    report = json.loads(env.outputs(job_id)["found.json"])
    assert report["found"] == [], "\n".join(report["found"])
    assert report["pids"] <= 3  # its own PID namespace: bwrap, the script (and a child)
    assert "sleeper started" in env.log(job_id, rank=0)
    # The run's PID namespace ended with the job, the sleeper with it.
    assert wait_until_gone(marker) == []
    assert processes_mentioning(marker) == []
    bob.close()
    admin.close()


# A script that attacks the agent through the folder it shares with it: it plants links
# where the agent used to write its own files, FIFOs where the agent reads, swaps a log file
# the agent already judged for a link to a host secret, leaves links in its outputs, and
# reports who it runs as.
SWAPPER = textwrap.dedent(
    """
    import json, os, time
    import mlflow
    from torch.utils.tensorboard import SummaryWriter

    targets = json.load(open("targets.json"))
    run = os.path.realpath(os.path.join(os.getcwd(), "..", ".."))
    out, logs = os.environ["TORCHYARD_OUTPUT_DIR"], os.environ["TORCHYARD_LOG_DIR"]
    report = {"uid": os.getuid(), "groups": os.getgroups()}
    try:
        open("/etc/shadow", "rb").read(1)
        report["shadow"] = "read"
    except OSError as exc:
        report["shadow"] = type(exc).__name__
    os.makedirs(os.path.join(run, "metrics"), exist_ok=True)
    for name, victim in targets["victims"].items():
        os.symlink(victim, os.path.join(run, name))
    os.mkfifo(os.path.join(run, "events.jsonl"))
    os.mkfifo(os.path.join(logs, "fifo.log"))
    os.mkfifo(os.path.join(out, "events.out.tfevents.0.fifo"))

    mlflow.start_run()
    mlflow.log_param("p", "1")
    mlflow.log_metric("mlflow_m", 1.0)
    mlflow.end_run()
    writer = SummaryWriter(os.path.join(out, "tb"))
    writer.add_scalar("tb_loss", 0.5, 1)
    writer.close()

    leak = os.path.join(logs, "leak.txt")
    with open(leak, "w") as fh:
        fh.write("first line of leak.txt\\n")
    time.sleep(3)  # judged a regular file and read by now
    os.symlink(targets["secret"], leak + ".new")
    os.replace(leak + ".new", leak)
    os.makedirs(os.path.join(logs, "sub"))
    with open(os.path.join(logs, "sub", "a.log"), "w") as fh:
        fh.write("a line of sub/a.log\\n")
    time.sleep(2)
    os.rename(os.path.join(logs, "sub"), os.path.join(logs, "sub.old"))
    os.symlink(os.path.dirname(targets["secret"]), os.path.join(logs, "sub"))
    with open(leak + ".2", "w") as fh:
        fh.write("more\\n")
    os.symlink(targets["secret"], os.path.join(out, "secret-link"))
    os.symlink(os.path.dirname(targets["secret"]), os.path.join(out, "folder-link"))
    os.symlink(targets["secret"], os.path.join(logs, "secret-link.log"))
    with open(os.path.join(out, "report.json"), "w") as fh:
        json.dump(report, fh)
    time.sleep(2)
    print("swapper done", flush=True)
    """
)


def test_the_agent_follows_no_link_nor_fifo_of_the_run_and_the_run_is_unprivileged(
    env: ScriptEnv, tmp_path: Path
) -> None:
    import os
    import secrets

    agent = env.agent("swapped", slots=1)
    host = tmp_path / "host"
    host.mkdir(mode=0o700)
    secret = host / "node-secret"
    token = f"SECRET-{secrets.token_hex(16)}"
    secret.write_text(token + "\n")
    secret.chmod(0o600)
    # Files of the host the agent would write through the links, had it followed them.
    victims = {}
    for name in (
        ".tracking.json.tmp",
        "tracking.json",
        "metrics/mlflow-rank-0.jsonl",
        "metrics/tensorboard.jsonl",
        "outputs.tar.gz",
    ):
        victim = host / f"victim-{name.replace('/', '-')}"
        victim.write_text(f"untouched {name}\n")
        victims[name] = str(victim)
    before = {name: Path(path).read_bytes() for name, path in victims.items()}
    code = env.upload_code(
        {"swapper.py": SWAPPER, "targets.json": json.dumps({"victims": victims, "secret": str(secret)})}
    )
    job_id = env.submit(code, ["python", "swapper.py"])
    job = env.wait(job_id, timeout=120)
    assert job["status"] == "succeeded", (job, env.log(job_id, rank=0))
    assert "swapper done" in env.log(job_id, rank=0)

    # Nothing of the host was written, and the secret reached no stream nor the outputs.
    assert {name: Path(path).read_bytes() for name, path in victims.items()} == before
    streams = env.user.get(f"/v1/jobs/{job_id}/logs/streams").json()
    names = [s["name"] for s in (streams["streams"] if isinstance(streams, dict) else streams)]
    assert "file-0/leak.txt" in names, names
    for name in names:
        text = env.log(job_id, stream=name)
        assert token not in text, name
    assert "first line of leak.txt" in env.log(job_id, stream="file-0/leak.txt")
    outputs = env.outputs(job_id)
    assert all(token.encode() not in data for data in outputs.values())
    assert "secret-link" not in outputs and not any(n.startswith("folder-link") for n in outputs)
    assert "logs/sub.old/a.log" in outputs and "logs/secret-link.log" not in outputs

    # The agent still reads its own files: the MLflow and TensorBoard metrics arrived.
    metrics = env.user.get(f"/v1/jobs/{job_id}/metrics").json()
    assert {"mlflow_m", "tb_loss"} <= {m["name"] for m in metrics["items"]}, metrics

    report = json.loads(outputs["report.json"])
    if os.geteuid() == 0:  # a root agent runs the job as nobody, without groups
        assert report["uid"] == 65534 and report["shadow"] == "PermissionError", report
        assert 0 not in report["groups"], report
    # The run's folder holds what the job made; the agent's own files are elsewhere.
    run_dir = next((agent.work_dir / "runs").glob(f"{job_id}-*"))
    placement = agent.work_dir / "placements" / run_dir.name
    assert (placement / "agent.log").is_file() and not (run_dir / "agent.log").exists()
    assert (run_dir / "tracking.json").is_symlink()  # its own link, never written through


# A job with no network: the API, the node's loopback services and the outside are out of
# reach; its MLflow endpoint still answers, and each of its ranks' points keeps its rank.
OFFLINE = textwrap.dedent(
    """
    import json, os, socket, subprocess, sys

    targets = json.load(open("targets.json"))
    reached = []
    for host, port in targets["addresses"]:
        try:
            socket.create_connection((host, port), timeout=3).close()
            reached.append(f"{host}:{port}")
        except OSError:
            pass
    with open(os.path.join(os.environ["TORCHYARD_OUTPUT_DIR"], "reached.json"), "w") as fh:
        json.dump(reached, fh)
    rank_code = "import mlflow, os; mlflow.log_metric('offline_rank', float(os.environ['RANK']), step=0)"
    children = [subprocess.Popen([sys.executable, "-c", rank_code], env={**os.environ, "RANK": str(r)}) for r in (0, 1)]
    sys.exit(max(c.wait() for c in children))
    """
)


def test_a_job_without_network_reaches_nothing_but_its_mlflow_endpoint(env: ScriptEnv) -> None:
    from urllib.parse import urlsplit

    env.agent("offline", slots=2)
    api = urlsplit(env.server.url)
    addresses = [[api.hostname, api.port], ["127.0.0.1", 5432], ["127.0.0.1", 22]]
    code = env.upload_code({"offline.py": OFFLINE, "targets.json": json.dumps({"addresses": addresses})})
    body = {
        "type": "script",
        "code": code,
        "command": ["python", "offline.py"],
        "environment": {"network": "none"},
        "distribution": {"launch": "per_node"},
        "resources": {"process_count_per_node": 2},
    }
    r = env.user.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = env.wait(job_id, timeout=120)
    assert job["status"] == "succeeded", (job, env.log(job_id, rank=0))
    assert json.loads(env.outputs(job_id)["reached.json"]) == []
    points = env.user.get(f"/v1/jobs/{job_id}/metrics", params={"name": "offline_rank"}).json()["items"]
    assert sorted((p["rank"], p["value"]) for p in points) == [(0, 0.0), (1, 1.0)]
    # A control: the same reach test with the node's network finds the API.
    code = env.upload_code({"offline.py": OFFLINE, "targets.json": json.dumps({"addresses": addresses[:1]})})
    job_id = env.submit(code, ["python", "offline.py"], distribution={"launch": "per_node"})
    assert env.wait(job_id, timeout=120)["status"] == "succeeded"
    assert json.loads(env.outputs(job_id)["reached.json"]) == [f"{api.hostname}:{api.port}"]
