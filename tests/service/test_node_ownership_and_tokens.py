"""Who may speak for a node, token revocation, and what a worker token may reach.

* A node name belongs to the worker token that registered it, and to one live agent of
  that token at a time (its per-node key): others get 409 and change nothing.
* Tokens can be listed and revoked; a revoked token is refused at once by every API
  replica sharing the database.
* Ranks never see the worker token; a worker token downloads only the models of jobs on
  its own nodes.

Real HTTP against live servers, real agent processes, a real torchrun.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event, select, update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, Node, Token
from service.db.types import utcnow
from service.services.tokens import Principal, UseRecorder
from service.states import Role
from tests.conftest import LiveServer, fast_leases, free_port
from tests.support.factories import auth, create_token, insert_dataset, job_spec, token_id
from tests.support.report_helpers import finish_job, set_placement, start_running_job, write_fake_model_dir
from tests.support.worker_fixtures import start_agent, wait_for_node, worker_token
from worker.agent.marked_processes import MARKER_VAR
from worker.agent.rank_group import LaunchSpec, RankGroup, torchrun_command
from worker.agent.reporting import download_model, upload_model

# The database makes a difference here: every test runs on SQLite and on PostgreSQL.
pytestmark = pytest.mark.both_databases


LEASE = "X-Torchyard-Lease"
AGENT_KEY = "X-Torchyard-Agent-Key"
# Long enough that no node or lease of these tests goes stale by itself: where a test
# needs a silent node, it moves the last heartbeat back in the database.
LEASE_TIMEOUT_S = 600.0


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(**fast_leases(lease_s=LEASE_TIMEOUT_S))
    return s


@pytest.fixture
def admin(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=30) as c:
        yield c


def _db(settings: Settings) -> Database:
    return Database(settings.sqlalchemy_url)


def _node_row(settings: Settings, name: str) -> Node:
    db = _db(settings)
    try:
        with db.read_session() as s:
            return s.scalars(select(Node).where(Node.name == name)).one()
    finally:
        db.dispose()


def _silence_node(settings: Settings, name: str) -> None:
    """As if the node's agent had not heartbeated for twice the lease timeout."""
    db = _db(settings)
    try:
        with db.transaction() as s:
            s.execute(
                update(Node)
                .where(Node.name == name)
                .values(last_heartbeat_at=utcnow() - timedelta(seconds=2 * LEASE_TIMEOUT_S))
            )
    finally:
        db.dispose()


# --------------------------------------------------------------------------- node identity


@dataclass
class Worker:
    """One agent's view of the worker routes: its token and its per-node key."""

    http: httpx.Client
    key: str

    def register(self, name: str, units: int) -> httpx.Response:
        body = {
            "name": name,
            "address": "127.0.0.1",
            "units": units,
            "accelerator": "cpu",
            "agent_key": self.key,
        }
        return self.http.post("/v1/worker/nodes", json=body)

    def heartbeat(self, name: str, leases: list[str]) -> httpx.Response:
        return self.http.post(
            f"/v1/worker/nodes/{name}/heartbeat", json={"leases": leases}, headers={AGENT_KEY: self.key}
        )

    def claim(self, name: str, wait: float = 0) -> httpx.Response:
        return self.http.post(
            f"/v1/worker/nodes/{name}/claim", params={"wait": wait}, headers={AGENT_KEY: self.key}
        )


@dataclass
class Scene:
    """Node n1 (1 unit) registered by agent ``a``, running one job of user ``user``."""

    admin: httpx.Client
    user: httpx.Client
    a: Worker
    job_id: str
    lease: str
    spec: dict[str, Any]

    def assert_untouched(self) -> None:
        """n1 still has 1 unit, held by the job, which still runs; its agent still renews it."""
        nodes = {n["name"]: n for n in self.admin.get("/v1/cluster").json()["nodes"]}
        assert nodes["n1"]["units"] == 1 and nodes["n1"]["used_units"] == 1, nodes["n1"]
        assert nodes["n1"]["status"] == "ready"
        assert self.user.get(f"/v1/jobs/{self.job_id}").json()["status"] == "running"
        r = self.a.heartbeat("n1", [self.lease])
        assert r.status_code == 200, r.text
        assert [x["lease_token"] for x in r.json()["renewed"]] == [self.lease]
        assert r.json()["stop"] == []
        # The node's one unit is taken: a second job waits instead of piling onto it.
        r = self.user.post("/v1/jobs", json=self.spec)
        assert r.status_code == 201, r.text
        assert self.a.claim("n1").status_code == 204
        assert self.user.get(f"/v1/jobs/{r.json()['id']}").json()["status"] == "queued"


@pytest.fixture
def scene(live_server: LiveServer, settings: Settings, admin: httpx.Client) -> Iterator[Scene]:
    user_token = create_token(admin, "user", "alice")
    uid = token_id(admin, user_token)
    spec = job_spec(
        insert_dataset(settings, uid), insert_dataset(settings, uid), resources={"process_count_per_node": 1}
    )
    user = httpx.Client(base_url=live_server.url, headers=auth(user_token), timeout=30)
    http = httpx.Client(base_url=live_server.url, headers=auth(create_token(admin, "worker")), timeout=30)
    a = Worker(http, secrets.token_hex(16))
    assert a.register("n1", units=1).status_code == 200
    r = user.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    r = a.claim("n1", wait=5)
    assert r.status_code == 200, r.text
    lease = r.json()["lease_token"]
    r = a.http.post("/v1/worker/placements/status", json={"state": "running"}, headers={LEASE: lease})
    assert r.status_code == 200, r.text
    yield Scene(admin, user, a, job_id, lease, spec)
    user.close()
    a.http.close()


def test_another_worker_token_cannot_take_a_node(scene: Scene, live_server: LiveServer) -> None:
    other = Worker(
        httpx.Client(base_url=live_server.url, headers=auth(create_token(scene.admin, "worker")), timeout=30),
        secrets.token_hex(16),
    )
    r = other.register("n1", units=64)
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "NodeNameInUseError"
    assert "another worker token" in r.json()["message"]
    # Nor can it speak for the node in any other way.
    assert other.heartbeat("n1", [scene.lease]).status_code == 404
    assert other.claim("n1").status_code == 404
    scene.assert_untouched()
    other.http.close()


def test_a_second_agent_of_the_same_token_is_refused_while_the_first_lives(
    scene: Scene, settings: Settings
) -> None:
    second = Worker(scene.a.http, secrets.token_hex(16))  # same token, another agent
    r = second.register("n1", units=64)
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "NodeNameInUseError"
    assert "another agent holds node name 'n1'" in r.json()["message"]
    assert "another --name" in r.json()["message"]
    # A registration without any key is no way around it.
    bare = {"name": "n1", "address": "127.0.0.1", "units": 64, "accelerator": "cpu"}
    assert scene.a.http.post("/v1/worker/nodes", json=bare).status_code == 409
    # Its heartbeats and claims are refused too: they would renew and take the first one's work.
    for r in (second.heartbeat("n1", []), second.claim("n1")):
        assert r.status_code == 409 and r.json()["code"] == "NodeNameInUseError", r.text
    scene.assert_untouched()
    assert _node_row(settings, "n1").units == 1


def test_a_silent_node_is_taken_over_and_its_old_agent_told_to_stop(scene: Scene, settings: Settings) -> None:
    _silence_node(settings, "n1")
    second = Worker(scene.a.http, secrets.token_hex(16))
    r = second.register("n1", units=2)
    assert r.status_code == 200, r.text
    # What ran there is gone with the old agent; the old agent, should it speak again, must stop.
    assert scene.user.get(f"/v1/jobs/{scene.job_id}").json()["status"] != "running"
    r = scene.a.heartbeat("n1", [scene.lease])
    assert r.status_code == 409 and r.json()["code"] == "NodeNameInUseError", r.text
    assert "this agent must stop" in r.json()["message"]
    assert scene.a.claim("n1").status_code == 409
    assert second.heartbeat("n1", []).status_code == 200


def test_the_same_agent_registers_again_at_once(live_server: LiveServer, admin: httpx.Client) -> None:
    """An agent restarted with its key (same work directory) needs no wait."""
    a = Worker(httpx.Client(base_url=live_server.url, headers=auth(create_token(admin, "worker"))), "k" * 32)
    assert a.register("n2", units=1).status_code == 200
    assert a.register("n2", units=1).status_code == 200
    assert a.heartbeat("n2", []).status_code == 200
    a.http.close()


def test_agents_started_twice_with_one_name_get_a_clear_error(sqlite_url: str, tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=sqlite_url,
        **fast_leases(lease_s=LEASE_TIMEOUT_S),
    )
    server = LiveServer(settings).start()
    admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=30)
    token = worker_token(admin)
    agents = []
    try:
        first = start_agent(server.url, token, "n1", tmp_path / "wa", slots=1)
        agents.append(first)
        wait_for_node(admin, "n1", timeout=120)
        assert _node_row(settings, "n1").info["pid"] == first.process.pid  # type: ignore[index]

        # Same token and name, another work directory: refused by the API, exits saying why.
        second = start_agent(server.url, token, "n1", tmp_path / "wb", slots=4)
        agents.append(second)
        assert second.process.wait(120) != 0
        log = second.log_text()
        assert "NodeNameInUseError" in log and "another agent holds node name 'n1'" in log, log
        # Same work directory: refused before it could touch the first one's processes.
        third = start_agent(server.url, token, "n1", tmp_path / "wa", slots=2)
        agents.append(third)
        assert third.process.wait(120) != 0
        assert "another agent of node 'n1' is running with work directory" in third.log_text()

        assert first.alive(), first.log_text()
        row = _node_row(settings, "n1")
        assert row.units == 1 and row.info is not None and row.info["pid"] == first.process.pid

        # The first agent crashes; restarted in its work directory it takes its node back
        # at once (its lease has not run out: another agent would still be refused).
        first.kill()
        restarted = start_agent(server.url, token, "n1", tmp_path / "wa", slots=1)
        agents.append(restarted)
        deadline = time.monotonic() + 120
        while (_node_row(settings, "n1").info or {}).get("pid") != restarted.process.pid:
            assert restarted.alive(), restarted.log_text()
            assert time.monotonic() < deadline, restarted.log_text()
            time.sleep(0.2)

        # Its token revoked, the agent stops instead of retrying forever.
        tid = token_id(admin, token)
        assert admin.delete(f"/v1/tokens/{tid}").status_code == 200
        assert restarted.process.wait(120) != 0
        assert "AuthenticationError" in restarted.log_text()
    finally:
        for agent in agents:
            agent.stop(30)
        admin.close()
        server.stop()


# --------------------------------------------------------------------------- tokens


def test_tokens_are_listed_without_secrets_and_revoked_on_every_replica(settings: Settings) -> None:
    one = LiveServer(settings).start()
    two = LiveServer(settings).start()  # another API process on the same database
    admin_one = httpx.Client(base_url=one.url, headers=auth(one.admin_token), timeout=30)
    admin_two = httpx.Client(base_url=two.url, headers=auth(two.admin_token), timeout=30)
    try:
        created = admin_one.post("/v1/tokens", json={"name": "bob", "role": "user"}).json()
        plain = created["token"]
        idle = create_token(admin_one, "worker", "idle-worker")
        assert httpx.get(f"{two.url}/v1/jobs", headers=auth(plain)).status_code == 200

        r = admin_two.get("/v1/tokens")
        assert r.status_code == 200, r.text
        items = {t["name"]: t for t in r.json()["items"]}
        assert set(items["bob"]) == {"id", "name", "role", "created_at", "last_used_at", "revoked_at"}
        assert items["bob"]["id"] == created["id"] and items["bob"]["role"] == "user"
        assert items["bob"]["last_used_at"] is not None and items["bob"]["revoked_at"] is None
        assert items["idle-worker"]["last_used_at"] is None
        db = _db(settings)
        with db.read_session() as s:
            hashes = list(s.scalars(select(Token.token_hash)))
        db.dispose()
        for secret in [plain, idle, one.admin_token, *hashes]:
            assert secret not in r.text

        r = admin_one.delete(f"/v1/tokens/{created['id']}")
        assert r.status_code == 200, r.text
        assert r.json()["revoked_at"] is not None and "token" not in r.json()
        # Refused at once, by both processes.
        for server in (two, one):
            r = httpx.get(f"{server.url}/v1/jobs", headers=auth(plain))
            assert r.status_code == 401 and r.json()["code"] == "AuthenticationError"
        assert admin_two.delete(f"/v1/tokens/{created['id']}").status_code == 200  # idempotent
        active = admin_two.get("/v1/tokens", params={"include_revoked": "false"}).json()["items"]
        assert "bob" not in {t["name"] for t in active}
    finally:
        admin_one.close()
        admin_two.close()
        two.stop()
        one.stop()


def test_token_routes_refuse_bad_requests(live_server: LiveServer, admin: httpx.Client) -> None:
    user = create_token(admin, "user")
    r = httpx.get(f"{live_server.url}/v1/tokens", headers=auth(user))
    assert r.status_code == 403
    me = token_id(admin, live_server.admin_token)
    assert httpx.delete(f"{live_server.url}/v1/tokens/{me}", headers=auth(user)).status_code == 403
    r = admin.delete("/v1/tokens/does-not-exist")
    assert r.status_code == 404 and r.json()["code"] == "NotFoundError"
    # The last admin token cannot be revoked: nobody could manage tokens any more.
    r = admin.delete(f"/v1/tokens/{me}")
    assert r.status_code == 409 and "last admin token" in r.json()["message"]
    assert admin.get("/v1/whoami").status_code == 200
    second_admin = create_token(admin, "admin")
    assert admin.delete(f"/v1/tokens/{me}").status_code == 200
    assert admin.get("/v1/whoami").status_code == 401
    assert httpx.get(f"{live_server.url}/v1/tokens", headers=auth(second_admin)).status_code == 200


def test_last_used_is_written_at_most_once_a_minute(
    live_server: LiveServer, admin: httpx.Client, settings: Settings
) -> None:
    user = create_token(admin, "user")
    uid = token_id(admin, user)

    def last_used() -> Any:
        db = _db(settings)
        try:
            with db.read_session() as s:
                return s.get_one(Token, uid).last_used_at
        finally:
            db.dispose()

    first = last_used()
    assert first is not None  # token_id() used it
    for _ in range(3):
        assert httpx.get(f"{live_server.url}/v1/jobs", headers=auth(user)).status_code == 200
    assert last_used() == first
    db = _db(settings)
    with db.transaction() as s:
        s.execute(update(Token).where(Token.id == uid).values(last_used_at=first - timedelta(minutes=5)))
    db.dispose()
    assert httpx.get(f"{live_server.url}/v1/jobs", headers=auth(user)).status_code == 200
    assert last_used() > first - timedelta(seconds=1)


def test_simultaneous_requests_write_last_used_once(live_server: LiveServer, admin: httpx.Client) -> None:
    app = live_server.server.config.app
    updates: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE TOKENS"):
            updates.append(statement)

    plain = create_token(admin, "user")  # never used yet: the first requests all find it due
    engine = app.state.db.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        with ThreadPoolExecutor(16) as pool:
            codes = list(
                pool.map(
                    # 32 requests on a machine whose every core is busy take more than httpx's
                    # 5 s default: this counts writes, it does not time the API.
                    lambda _: (
                        httpx.get(f"{live_server.url}/v1/jobs", headers=auth(plain), timeout=60).status_code
                    ),
                    range(32),
                )
            )
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert codes == [200] * 32
    assert len(updates) == 1, updates


def test_use_recorder_lets_one_request_write_each_stale_value() -> None:
    recorder = UseRecorder()
    now = utcnow()
    never = Principal(id="t1", name="t", role=Role.USER)
    assert recorder.should_record(never, now)
    assert not recorder.should_record(never, now)  # a write for this stale value is under way
    recorder.failed("t1")
    assert recorder.should_record(never, now)  # it failed: the next request tries again
    fresh = Principal(id="t1", name="t", role=Role.USER, last_used_at=now - timedelta(seconds=5))
    assert not recorder.should_record(fresh, now)  # written within the minute
    stale = Principal(id="t1", name="t", role=Role.USER, last_used_at=now - timedelta(minutes=2))
    assert recorder.should_record(stale, now) and not recorder.should_record(stale, now)


def test_a_revoked_workers_node_name_can_be_registered_by_another_token(
    live_server: LiveServer, admin: httpx.Client
) -> None:
    old, new = create_token(admin, "worker"), create_token(admin, "worker")
    node = {"name": "n3", "address": "127.0.0.1", "units": 1, "accelerator": "cpu"}
    url = f"{live_server.url}/v1/worker/nodes"
    assert httpx.post(url, json=node, headers=auth(old)).status_code == 200
    assert httpx.post(url, json=node, headers=auth(new)).status_code == 409
    assert admin.delete(f"/v1/tokens/{token_id(admin, old)}").status_code == 200
    assert httpx.post(url, json=node, headers=auth(old)).status_code == 401
    assert httpx.post(url, json=node, headers=auth(new)).status_code == 200


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cli_lists_and_revokes_tokens(live_server: LiveServer, admin: httpx.Client) -> None:
    plain = create_token(admin, "user", "carol")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_URL=live_server.url, TORCHYARD_TOKEN=live_server.admin_token)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "torchyard.cli", "token", *args],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split() == [
        "ID",
        "NAME",
        "ROLE",
        "CREATED",
        "LAST",
        "USED",
        "STATUS",
    ]
    carol = next(line for line in listed.stdout.splitlines() if " carol " in line)
    assert "active" in carol and plain not in listed.stdout
    revoked = cli("revoke", "carol")
    assert revoked.returncode == 0, revoked.stderr
    assert "revoked token" in revoked.stdout
    assert httpx.get(f"{live_server.url}/v1/jobs", headers=auth(plain)).status_code == 401
    rows = json.loads(cli("list", "--json").stdout)
    assert next(t for t in rows if t["name"] == "carol")["revoked_at"] is not None
    missing = cli("revoke", "nobody")
    assert missing.returncode == 1 and "no token has the id 'nobody'" in missing.stderr


# --------------------------------------------------------------------------- what a worker token reaches


def test_ranks_started_by_the_launcher_never_see_the_worker_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "ty_" + secrets.token_urlsafe(32)
    monkeypatch.setenv("TORCHYARD_TOKEN", token)
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", "postgresql://svc:hunter2@db/torchyard")
    run_dir = tmp_path / "work" / "runs" / "job-a1-n1"
    run_dir.mkdir(parents=True)
    script = run_dir / "dump_env.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os
            with open(f"env-rank-{os.environ['RANK']}.json", "w") as fh:
                json.dump(dict(os.environ), fh)
            """
        )
    )
    spec = LaunchSpec(
        run_dir=run_dir, node_name="n1", node_rank=0, node_count=1, nproc=2,
        master_addr="127.0.0.1", master_port=free_port(), cpus=2,
    )  # fmt: skip
    group = RankGroup(spec)
    # The real torchrun of the launcher, running a script that records its rank's environment.
    trainer = torchrun_command(spec).index("-m", 3)
    group.command = [*torchrun_command(spec)[:trainer], str(script)]
    with open(tmp_path / "launcher.log", "w") as out:
        group.start(out)
    assert group.wait(180) == 0, (tmp_path / "launcher.log").read_text()
    for rank in (0, 1):
        env = json.loads((run_dir / f"env-rank-{rank}.json").read_text())
        assert env[MARKER_VAR] == group.marker  # started by the launcher, through torchrun
        assert "TORCHYARD_TOKEN" not in env and "TORCHYARD_DATABASE_URL" not in env
        assert not [k for k, v in env.items() if token in v or "hunter2" in v]


def test_a_worker_token_downloads_only_models_of_jobs_on_its_nodes(
    settings: Settings, live_server: LiveServer, admin: httpx.Client, tmp_path: Path
) -> None:
    source = start_running_job(settings, admin)
    ran_it = httpx.Client(base_url=live_server.url, headers=auth(source.worker_token))
    upload_model(ran_it, source.job_id, source.lease, write_fake_model_dir(tmp_path / "model"))
    finish_job(settings, source, "succeeded")
    # A fine-tuning job starting from that model, placed on another worker token's node.
    tuning = start_running_job(settings, admin)
    db = _db(settings)
    with db.transaction() as s:
        s.execute(update(Job).where(Job.id == tuning.job_id).values(init_from_job_id=source.job_id))
    db.dispose()
    tuner = httpx.Client(base_url=live_server.url, headers=auth(tuning.worker_token))
    stranger = httpx.Client(base_url=live_server.url, headers=auth(create_token(admin, "worker")))
    url = f"/v1/worker/jobs/{source.job_id}/model"
    try:
        r = stranger.get(url)
        assert r.status_code == 403 and r.json()["code"] == "PermissionDeniedError", r.text
        assert stranger.head(url).status_code == 403
        assert stranger.get("/v1/worker/jobs/nope/model").status_code == 404
        assert ran_it.get(url).status_code == 200
        dest = download_model(tuner, source.job_id, tmp_path / "init")
        assert (dest / "model.safetensors").exists()
        # Once the fine-tuning placement is over, that worker has no more business with it.
        set_placement(settings, tuning.placement_ids[0], status="done", finished_at=utcnow())
        assert tuner.get(url).status_code == 403
    finally:
        for c in (ran_it, tuner, stranger):
            c.close()
