"""Job types and script jobs at the API: the default type stays ``train``, code packages
(upload, list, show, delete, 409 while used, owner only, unsafe archives refused) and bad
script specs (each a 4xx naming the field)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from tests.support.dataset_files import tar_with
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id


def code_archive(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def upload_code(client: TestClient, files: dict[str, bytes], **kw: Any) -> Any:
    return client.post(
        "/v1/code", files={"file": ("src.tar.gz", code_archive(files), "application/gzip")}, **kw
    )


@pytest.fixture
def ready(client: TestClient, settings: Settings) -> dict[str, str]:
    register_node(client, create_token(client, "worker"), "node-a", units=4)
    me = token_id(client, client.headers["Authorization"].split()[1])
    code = upload_code(client, {"train.py": b"print('hi')\n", "pkg/util.py": b"X = 1\n"})
    assert code.status_code == 201, code.text
    return {"data": insert_dataset(settings, me, name="data"), "code": code.json()["id"]}


def script_spec(code_id: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "script", "code": code_id, "command": ["python", "train.py"]}
    spec.update(overrides)
    return spec


def errors_of(r: Any) -> list[str]:
    return [e["field"] for e in r.json().get("errors", [])]


def test_a_spec_without_type_is_a_training_job(client: TestClient, settings: Settings) -> None:
    register_node(client, create_token(client, "worker"), "node-a", units=2)
    me = token_id(client, client.headers["Authorization"].split()[1])
    train, val = insert_dataset(settings, me, name="t"), insert_dataset(settings, me, name="v")
    r = client.post("/v1/jobs", json=job_spec(train, val))
    assert r.status_code == 201, r.text
    assert r.json()["type"] == "train" and r.json()["model"]["architecture"] == "resnet18"
    explicit = client.post("/v1/jobs", json={**job_spec(train, val), "type": "train"})
    assert explicit.status_code == 201 and explicit.json()["type"] == "train"
    # A training field error keeps its plain name, not the union's tag.
    bad = client.post("/v1/jobs", json={**job_spec(train, val), "parameters": {"epochs": 0}})
    assert bad.status_code == 422 and errors_of(bad) == ["parameters.epochs"]
    unknown = client.post("/v1/jobs", json={**job_spec(train, val), "type": "notebook"})
    assert unknown.status_code == 422 and errors_of(unknown) == ["type"], unknown.text


def test_script_job_is_queued_with_its_spec_normalized(client: TestClient, ready: dict[str, str]) -> None:
    r = client.post(
        "/v1/jobs",
        json=script_spec(
            ready["code"],
            command=["python", "train.py", "--rank", "$RANK"],
            inputs={"data": ready["data"]},
            environment={"variables": {"K": "V"}},
            resources={"node_count": 1, "process_count_per_node": 2, "max_restarts": 0},
        ),
    )
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["type"] == "script" and body["status"] == "queued"
    assert body["code"] == ready["code"]
    assert body["command"] == ["python", "train.py", "--rank", "$RANK"]
    assert body["distribution"] == {"launch": "per_process"}
    assert body["inputs"] == {"data": ready["data"]}
    assert body["environment"]["variables"] == {"K": "V"} and body["environment"]["pip"] == []
    assert body["environment"]["build_timeout_s"] == 900
    assert body["outputs"] == "node0"
    assert body["resources"]["max_restarts"] == 0 and body["resources"]["hang_timeout_s"] == 1800
    assert body["model"] is None and body["parameters"] is None
    shown = client.get(f"/v1/jobs/{body['id']}").json()
    assert shown["type"] == "script" and shown["command"] == body["command"]
    # The code package and the input dataset are in use: neither can be deleted.
    assert client.delete(f"/v1/code/{ready['code']}").status_code == 409
    assert client.delete(f"/v1/datasets/{ready['data']}").status_code == 409
    client.post(f"/v1/jobs/{body['id']}/cancel")
    # The app's scheduler may have placed it (no agent here): the reaper ends the cancel.
    deadline = time.monotonic() + 60
    while client.get(f"/v1/jobs/{body['id']}").json()["status"] != "cancelled":
        assert time.monotonic() < deadline, "the job did not end cancelled"
        time.sleep(0.1)
    assert client.delete(f"/v1/code/{ready['code']}").status_code == 204
    assert client.get(f"/v1/code/{ready['code']}").status_code == 404


@pytest.mark.parametrize(
    ("overrides", "field", "status"),
    [
        ({"distribution": {"launch": "per_gpu"}}, "distribution.launch", 422),
        ({"command": []}, "command", 422),
        ({"command": [""]}, "command", 422),
        ({"code": "0" * 32}, "code", 404),
        ({"inputs": {"data": "0" * 32}}, "inputs.data", 404),
        ({"environment": {"variables": {"RANK": "3"}}}, "environment.variables", 422),
        ({"environment": {"pip": ["--index-url=http://x"]}}, "environment.pip", 422),
        ({"environment": {"pip": [" --index-url=http://x"]}}, "environment.pip", 422),
        ({"environment": {"pip": ["x @ http://example.invalid/x.tar.gz"]}}, "environment.pip", 422),
        ({"environment": {"pip": ["x @ file:///etc/x"]}}, "environment.pip", 422),
        ({"environment": {"pip": ["./local-folder"]}}, "environment.pip", 422),
        ({"environment": {"pip": ["https://example.invalid/x.whl"]}}, "environment.pip", 422),
        ({"environment": {"build_timeout_s": 29}}, "environment.build_timeout_s", 422),
        ({"environment": {"build_timeout_s": 7201}}, "environment.build_timeout_s", 422),
        ({"environment": {"build_timeout_s": None}}, "environment.build_timeout_s", 422),
        ({"model": {"architecture": "resnet18"}}, "model", 422),
        ({"resources": {"process_count_per_node": 5}}, "process_count_per_node", 422),
    ],
)
def test_bad_script_specs_name_the_field(
    client: TestClient, ready: dict[str, str], overrides: dict[str, Any], field: str, status: int
) -> None:
    r = client.post("/v1/jobs", json=script_spec(ready["code"], **overrides))
    assert r.status_code == status, r.text
    body = r.json()
    assert field in " ".join([*errors_of(r), str(body.get("details")), body["message"]]), body


@pytest.mark.parametrize("seconds", [30, 1200, 7200])
def test_build_timeout_in_range_is_accepted(client: TestClient, ready: dict[str, str], seconds: int) -> None:
    pip = {"pip": ["some-package==1.2"], "build_timeout_s": seconds}
    r = client.post("/v1/jobs", json=script_spec(ready["code"], environment=pip))
    assert r.status_code == 201, r.text
    assert r.json()["environment"]["build_timeout_s"] == seconds
    client.post(f"/v1/jobs/{r.json()['id']}/cancel")


def test_build_timeout_out_of_range_says_what_is_allowed(client: TestClient, ready: dict[str, str]) -> None:
    r = client.post("/v1/jobs", json=script_spec(ready["code"], environment={"build_timeout_s": 10}))
    assert r.status_code == 422 and errors_of(r) == ["environment.build_timeout_s"], r.text
    assert ">= 30 and <= 7200" in r.text, r.text


@pytest.mark.parametrize(
    ("extra", "accepted"),
    [
        ({}, True),
        ({"distribution": {"launch": "per_node"}, "resources": {"process_count_per_node": 2}}, True),
        ({"resources": {"node_count": 2}}, False),
        ({"resources": {"process_count_per_node": 2}}, False),
    ],
)
def test_a_network_of_its_own_is_for_one_node_and_one_sandbox(
    client: TestClient, ready: dict[str, str], extra: dict[str, Any], accepted: bool
) -> None:
    spec = script_spec(ready["code"], environment={"network": "none"}, **extra)
    r = client.post("/v1/jobs", json=spec)
    if accepted:
        assert r.status_code == 201 and r.json()["environment"]["network"] == "none", r.text
        client.post(f"/v1/jobs/{r.json()['id']}/cancel")
    else:
        assert r.status_code == 422 and "environment.network none" in r.text, r.text
    r = client.post("/v1/jobs", json=script_spec(ready["code"], environment={"network": "off"}))
    assert r.status_code == 422 and "host or none" in r.text, r.text


def test_missing_code_field(client: TestClient, ready: dict[str, str]) -> None:
    r = client.post("/v1/jobs", json={"type": "script", "command": ["python", "x.py"]})
    assert r.status_code == 422 and errors_of(r) == ["code"], r.text


def test_another_users_code_is_not_found(client: TestClient, ready: dict[str, str]) -> None:
    other = auth(create_token(client, "user", "other"))
    r = client.post("/v1/jobs", json=script_spec(ready["code"]), headers=other)
    assert r.status_code == 404 and r.json()["details"]["field"] == "code", r.text
    assert client.get(f"/v1/code/{ready['code']}", headers=other).status_code == 404
    assert client.get("/v1/code", headers=other).json()["items"] == []
    assert client.delete(f"/v1/code/{ready['code']}", headers=other).status_code == 404


def test_code_upload_list_show_and_content_address(client: TestClient, settings: Settings) -> None:
    files = {"train.py": b"print(1)\n", "lib/a.py": b"A = 2\n", ".git/config": b"secret"}
    first = upload_code(client, files, data={"name": "finetune"})
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["name"] == "finetune" and body["files"] == 2  # hidden files are not part of it
    assert body["size_bytes"] == len(b"print(1)\n") + len(b"A = 2\n")
    second = upload_code(client, files).json()
    assert second["sha256"] == body["sha256"] and second["id"] != body["id"]
    stored = settings.data_dir / "code" / body["sha256"]
    assert sorted(p.relative_to(stored).as_posix() for p in stored.rglob("*") if p.is_file()) == [
        "lib/a.py",
        "train.py",
    ]
    listed = client.get("/v1/code").json()["items"]
    assert [c["id"] for c in listed] == [second["id"], body["id"]]
    assert client.get(f"/v1/code/{body['id']}").json()["sha256"] == body["sha256"]
    # Deleting one of two packages with the same content keeps the shared copy.
    assert client.delete(f"/v1/code/{body['id']}").status_code == 204
    assert stored.is_dir()
    assert client.delete(f"/v1/code/{second['id']}").status_code == 204
    assert not stored.exists()


@pytest.mark.parametrize(
    "members",
    [
        [("../evil.py", b"x", {})],
        [("link.py", b"", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"})],
        [("dev", b"", {"type": tarfile.CHRTYPE})],
    ],
    ids=["traversal", "symlink", "device"],
)
def test_unsafe_code_archives_are_refused(
    client: TestClient,
    settings: Settings,
    tmp_path: Path,
    members: list[tuple[str, bytes, dict[str, object]]],
) -> None:
    archive = tar_with(tmp_path / "bad.tar", [("ok.py", b"print(1)\n", {}), *members])
    r = client.post("/v1/code", files={"file": ("bad.tar", archive.read_bytes(), "application/x-tar")})
    assert r.status_code == 422 and r.json()["code"] == "InvalidCodeError", r.text
    store = settings.data_dir / "code"
    assert not [p for p in store.iterdir() if p.name not in (".staging", ".lock")]
    assert not list((store / ".staging").iterdir())


def test_code_upload_over_the_size_limit_is_413(make_settings: Any, tmp_path: Path) -> None:
    from service.api.app import create_app

    settings = make_settings(max_code_upload_bytes=1000)
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        r = upload_code(client, {"big.bin": os.urandom(4000)})
    assert r.status_code == 413, r.text


def test_cli_code_upload_warns_and_honours_the_ignore_file(live_server: Any, tmp_path: Path) -> None:
    import subprocess
    import sys

    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "train.py").write_text("print('hi')\n")
    (src / "data" / "big.bin").write_bytes(b"x" * 1000)
    (src / ".torchyardignore").write_text("data/\n")
    env = {**os.environ, "TORCHYARD_URL": live_server.url, "TORCHYARD_TOKEN": live_server.admin_token}
    r = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "code", "upload", str(src), "--name", "mine"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "WHOLE folder" in r.stderr and "1 files" in r.stderr and ".torchyardignore" in r.stderr
    code_id = r.stdout.strip()
    listed = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "code", "list", "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    [package] = [p for p in json.loads(listed.stdout) if p["id"] == code_id]
    assert package["name"] == "mine" and package["files"] == 1
    # torchyard code show: by id (or name), as text or JSON; an unknown one fails cleanly.
    shown = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "code", "show", "mine"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    lines = dict(line.split(":", 1) for line in shown.stdout.splitlines())
    assert {k: v.strip() for k, v in lines.items() if k in ("id", "name", "sha256")} == {
        "id": code_id, "name": "mine", "sha256": package["sha256"],
    }  # fmt: skip
    assert lines["files"].strip() == f"1 ({package['size_bytes']} B)"
    as_json = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "code", "show", code_id, "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == package, as_json.stderr
    unknown = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "code", "show", "nope"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert unknown.returncode != 0 and "not found" in unknown.stderr and "Traceback" not in unknown.stderr


def _wait_for_a_lock_wait(db: Any) -> None:
    """Until a session of the test's database waits on a row lock (PostgreSQL)."""
    from sqlalchemy import text

    deadline = time.monotonic() + 30
    while True:
        with db.read_session() as s:
            waiting = s.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )
        if waiting:
            return
        assert time.monotonic() < deadline, "no request waited for the code package's row lock"
        time.sleep(0.05)


@pytest.mark.both_databases
def test_code_deletion_and_a_submission_using_it_are_serialised(
    client: TestClient, settings: Settings, ready: dict[str, str]
) -> None:
    """A submission waits for a deletion of its code package in progress (then 404 naming
    ``code``); a deletion waits for a submission in progress (then 409 naming the job)."""
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import select

    from service.db.engine import Database
    from service.db.models import CodePackage, Job
    from service.db.types import utcnow

    if not settings.sqlalchemy_url.startswith("postgresql"):
        pytest.skip("row locks: SQLite serialises writers as a whole")
    me = token_id(client, client.headers["Authorization"].split()[1])
    db = Database(settings.sqlalchemy_url)
    try:
        with ThreadPoolExecutor(1) as pool:
            # A deletion holds the row (FOR UPDATE) and marks it deleted: the submission waits.
            with db.transaction() as holder:
                row = holder.scalars(
                    select(CodePackage).where(CodePackage.id == ready["code"]).with_for_update()
                ).one()
                submitted = pool.submit(client.post, "/v1/jobs", json=script_spec(ready["code"]))
                _wait_for_a_lock_wait(db)
                row.deleted_at = utcnow()
            r = submitted.result(timeout=60)
            assert r.status_code == 404 and r.json()["details"]["field"] == "code", r.text
            assert client.get("/v1/jobs").json()["items"] == []

            # A submission holds the row (FOR SHARE) and adds its job: the deletion waits.
            code = upload_code(client, {"other.py": b"print(2)\n"}).json()["id"]
            with db.transaction() as holder:
                holder.scalars(
                    select(CodePackage).where(CodePackage.id == code).with_for_update(read=True)
                ).one()
                deleted = pool.submit(client.delete, f"/v1/code/{code}")
                _wait_for_a_lock_wait(db)
                now = utcnow()
                job = Job(
                    owner_id=me, type="script", name="racing", status="queued", spec=script_spec(code),
                    code_id=code, node_count=1, process_count_per_node=1, priority=0,
                    created_at=now, updated_at=now,
                )  # fmt: skip
                holder.add(job)
                holder.flush()
                job_id = job.id
            r = deleted.result(timeout=60)
            assert r.status_code == 409 and r.json()["details"]["jobs"] == [job_id], r.text
            assert client.get(f"/v1/code/{code}").status_code == 200
    finally:
        db.dispose()
