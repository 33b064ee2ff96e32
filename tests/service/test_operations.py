"""Operations: list settings from the environment, zip bombs and the staging area,
what ``serve`` logs. Real ``torchyard serve`` processes where start-up matters."""

from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import struct
import subprocess
import sys
import tarfile
import threading
import time
import typing
import zipfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic_settings import NoDecode

from service.config import Settings
from service.datasets import staging
from tests.conftest import LiveServer, free_port
from tests.support.dataset_files import small_tree, zip_bomb, zip_tree
from tests.support.factories import auth, create_token
from torchyard.contract.errors import ConflictError

# ---------------------------------------------------------------------------- helpers


class Serve:
    """``torchyard serve`` as a child process with its own data directory; output in a file."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir.parent / f"serve-{self.port}.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        full_env = {**base, "TORCHYARD_DATA_DIR": str(data_dir), **(env or {})}
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torchyard.cli", "serve", "--port", str(self.port), *args],
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> Serve:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"serve did not come up:\n{self.log()}"
            time.sleep(0.1)

    @property
    def admin(self) -> dict[str, str]:
        return auth((self.data_dir / "admin.token").read_text().strip())

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        return self.log()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def wait_for(condition: typing.Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def staging_of(data_dir: Path) -> Path:
    return data_dir / "datasets" / ".staging"


def bytes_written_by_this_process() -> int:
    """Bytes this process passed to write() so far (files and sockets, every thread)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def upload(client: httpx.Client, archive: Path, name: str = "ds") -> httpx.Response:
    with open(archive, "rb") as f:
        return client.post("/v1/datasets", data={"name": name}, files={"file": (archive.name, f)})


class HeldUpload:
    """A multipart upload whose body stops after its first bytes until ``release()``."""

    def __init__(self, url: str, token: str, archive: Path) -> None:
        self.data = archive.read_bytes()
        self.gate = threading.Event()
        self.pool = ThreadPoolExecutor(1)
        self.future: Future[httpx.Response] = self.pool.submit(self._post, url, token)

    def _body(self) -> Iterator[bytes]:
        yield (
            b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="held.zip"\r\n'
            b"Content-Type: application/zip\r\n\r\n"
        )
        yield self.data[:1024]
        self.gate.wait(120)
        yield self.data[1024:]
        yield b"\r\n--b0undary--\r\n"

    def _post(self, url: str, token: str) -> httpx.Response:
        with httpx.Client(base_url=url, headers=auth(token), timeout=120) as c:
            return c.post(
                "/v1/datasets",
                content=self._body(),
                headers={"Content-Type": "multipart/form-data; boundary=b0undary"},
            )

    def release(self) -> httpx.Response:
        self.gate.set()
        try:
            return self.future.result(120)
        finally:
            self.pool.shutdown()


def part_files(staging_path: Path) -> list[Path]:
    return list(staging_path.glob("*/upload.part")) if staging_path.exists() else []


# ---------------------------------------------------------------------------- list settings from the environment


ROOT_FORMS = {
    "single path": lambda a, b: str(a),
    "comma list": lambda a, b: f"{a},{b}",
    "JSON list": lambda a, b: json.dumps([str(a), str(b)]),
}


@pytest.mark.parametrize("form", list(ROOT_FORMS))
def test_dataset_roots_from_the_environment_reach_serve(tmp_path: Path, form: str) -> None:
    """Each documented form of TORCHYARD_DATASET_ROOTS starts `db upgrade` and `serve`, and
    the roots it names are the ones registration accepts."""
    root_a, root_b, outside = tmp_path / "root-a", tmp_path / "root-b", tmp_path / "outside"
    for root in (root_a, root_b, outside):
        small_tree(root / "pets")
    value = ROOT_FORMS[form](root_a, root_b)
    expected = [root_a] if form == "single path" else [root_a, root_b]
    env = {"TORCHYARD_DATASET_ROOTS": value}

    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    up = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "db", "upgrade"],
        env={**base, "TORCHYARD_DATA_DIR": str(tmp_path / "data"), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert up.returncode == 0, up.stderr

    server = Serve(tmp_path / "data", env).wait_healthy()
    try:
        with httpx.Client(base_url=server.url, headers=server.admin, timeout=60) as c:
            for root in (root_a, root_b):
                r = c.post("/v1/datasets", json={"name": root.name, "path": str(root / "pets")})
                if root in expected:
                    assert r.status_code == 201, r.text
                else:
                    assert r.status_code == 403, r.text
            r = c.post("/v1/datasets", json={"name": "x", "path": str(outside / "pets")})
            assert r.status_code == 403, r.text
            assert r.json()["code"] == "PermissionDeniedError"
    finally:
        server.stop()


def test_malformed_json_roots_are_one_clear_line(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    r = subprocess.run(
        [sys.executable, "-m", "torchyard.cli", "serve", "--port", str(free_port())],
        env={**base, "TORCHYARD_DATA_DIR": str(tmp_path), "TORCHYARD_DATASET_ROOTS": '["/a", '},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2, r.stderr
    assert "error: InvalidSettingsError: TORCHYARD_DATASET_ROOTS: not a valid JSON list" in r.stderr
    assert "Traceback" not in r.stderr


def _is_collection(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_collection(typing.get_args(annotation)[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_is_collection(a) for a in typing.get_args(annotation))
    return origin in (list, dict, set, tuple, frozenset) or annotation in (list, dict, set, tuple, frozenset)


def test_every_collection_setting_reaches_its_validator_undecoded() -> None:
    """pydantic-settings JSON-decodes list and dict fields read from the environment before
    any validator runs, so a plain value fails; every such field must opt out (NoDecode)."""
    collections = {name: f for name, f in Settings.model_fields.items() if _is_collection(f.annotation)}
    assert "dataset_roots" in collections
    for name, field in collections.items():
        assert any(m is NoDecode or isinstance(m, NoDecode) for m in field.metadata), name


# ---------------------------------------------------------------------------- archives


@pytest.fixture
def bomb_server(sqlite_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    """The default extraction limits (8 GiB, ratio 100), one upload at a time per user."""
    settings = Settings(
        data_dir=tmp_path / "data", database_url=sqlite_url, max_concurrent_uploads_per_user=1
    )
    server = LiveServer(settings).start()
    yield server
    server.stop()


def _refused_writing_little(server: LiveServer, archive: Path, most: int) -> dict[str, Any]:
    """Upload ``archive``; it must be refused, this process having written at most ``most``
    bytes besides the upload itself (sent once, stored once), and nothing may remain."""
    size = archive.stat().st_size
    # The counter is the whole test process's: a thread another test left behind may write
    # meanwhile. The fewest bytes of up to three refused uploads is what the upload cost.
    tries: list[int] = []
    with httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=120) as c:
        while len(tries) < 3 and (not tries or min(tries) > most):
            before = bytes_written_by_this_process()
            r = upload(c, archive)
            tries.append(bytes_written_by_this_process() - before - 2 * size)
            assert r.status_code == 422, r.text
    written = min(tries)
    assert written <= most, f"{tries} bytes written for a refused {size}-byte archive"
    left = staging_of(server.settings.data_dir)
    assert not left.exists() or list(left.iterdir()) == []
    body: dict[str, Any] = r.json()
    return body


def test_zip_bomb_is_refused_before_anything_is_written(bomb_server: LiveServer, tmp_path: Path) -> None:
    """256 MiB of content in a ~256 KiB zip: under the 8 GiB limit, over 100 times its size."""
    archive = zip_bomb(tmp_path / "bomb.zip", size=256 * 1024 * 1024)
    assert archive.stat().st_size < 1024 * 1024
    body = _refused_writing_little(bomb_server, archive, most=2 * 1024 * 1024)
    assert body["code"] == "InvalidDatasetError"
    assert "100 times the size of the archive" in body["message"]
    assert "likely zip bomb (TORCHYARD_MAX_COMPRESSION_RATIO)" in body["message"]


def test_tar_bomb_member_refused_by_its_declared_size(bomb_server: LiveServer, tmp_path: Path) -> None:
    archive = tmp_path / "bomb.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        info = tarfile.TarInfo("a/zeros.png")
        info.size = 256 * 1024 * 1024
        tf.addfile(info, _Zeros(info.size))
    body = _refused_writing_little(bomb_server, archive, most=2 * 1024 * 1024)
    assert "member 'a/zeros.png' declares 268435456 bytes" in body["message"]


def test_many_member_tar_bomb_stops_at_the_cap(bomb_server: LiveServer, tmp_path: Path) -> None:
    """64 members of 1 MiB of zeros: each is small, the total is not; writing stops at the
    cap (16 MiB for an archive this small), not at the 8 GiB limit."""
    archive = tmp_path / "many.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for i in range(64):
            info = tarfile.TarInfo(f"a/{i}.png")
            info.size = 1024 * 1024
            tf.addfile(info, _Zeros(info.size))
    body = _refused_writing_little(bomb_server, archive, most=18 * 1024 * 1024)
    assert "more than 16777216 bytes" in body["message"]


def lying_zip(out: Path, *, real: int, declared: int) -> Path:
    """A zip whose one member holds ``real`` bytes of zeros but whose headers say ``declared``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a/zeros.png", bytes(real))
    data = bytearray(buf.getvalue())
    local, central = data.find(b"PK\x03\x04"), data.find(b"PK\x01\x02")
    struct.pack_into("<I", data, local + 22, declared)  # uncompressed size, local header
    struct.pack_into("<I", data, central + 24, declared)  # uncompressed size, central directory
    out.write_bytes(bytes(data))
    return out


def test_zip_lying_about_its_sizes_is_stopped(bomb_server: LiveServer, tmp_path: Path) -> None:
    archive = lying_zip(tmp_path / "liar.zip", real=64 * 1024 * 1024, declared=1000)
    with zipfile.ZipFile(archive) as zf:
        assert zf.infolist()[0].file_size == 1000
    body = _refused_writing_little(bomb_server, archive, most=2 * 1024 * 1024)
    assert body["code"] == "InvalidDatasetError"


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def test_concurrent_uploads_are_capped_per_user(bomb_server: LiveServer, tmp_path: Path) -> None:
    archive = zip_tree(small_tree(tmp_path / "pets"), tmp_path / "pets.zip")
    with httpx.Client(base_url=bomb_server.url, headers=auth(bomb_server.admin_token), timeout=60) as admin:
        alice, bob = create_token(admin, "user", "alice"), create_token(admin, "user", "bob")
    staging_path = staging_of(bomb_server.settings.data_dir)
    held = HeldUpload(bomb_server.url, alice, archive)
    try:
        wait_for(lambda: bool(part_files(staging_path)), "alice's upload to start")
        with httpx.Client(base_url=bomb_server.url, headers=auth(alice), timeout=60) as c:
            r = upload(c, archive, name="second")
            assert r.status_code == 409, r.text
            assert r.json()["code"] == "ConflictError"
            assert "TORCHYARD_MAX_CONCURRENT_UPLOADS_PER_USER" in r.json()["message"]
            assert r.json()["details"] == {"limit": 1}
        with httpx.Client(base_url=bomb_server.url, headers=auth(bob), timeout=60) as c:
            assert upload(c, archive, name="bob's").status_code == 201  # another user is not held up
    finally:
        first = held.release()
    assert first.status_code == 201, first.text
    with httpx.Client(base_url=bomb_server.url, headers=auth(alice), timeout=60) as c:
        assert upload(c, archive, name="third").status_code == 201  # the slot is free again
    assert list(staging_path.iterdir()) == []


# ---------------------------------------------------------------------------- staging left behind


def test_restart_after_kill_sweeps_what_the_upload_left(tmp_path: Path) -> None:
    data = tmp_path / "data"
    archive = zip_tree(small_tree(tmp_path / "pets"), tmp_path / "pets.zip")
    server = Serve(data).wait_healthy()
    held = HeldUpload(server.url, (data / "admin.token").read_text().strip(), archive)
    try:
        wait_for(lambda: bool(part_files(staging_of(data))), "the upload to start")
        server.kill()
    finally:
        held.gate.set()
        held.future.exception(60)  # the connection was cut
        held.pool.shutdown()
    left = list(staging_of(data).iterdir())
    assert left and part_files(staging_of(data)), "a killed upload leaves its folder"
    # Also an older leftover, and a folder another live process is extracting into.
    (staging_of(data) / "upload-0123.part").write_bytes(bytes(4096))
    busy = staging_of(data) / "u-elsewhere.0"
    busy.mkdir()
    (busy / "upload.part").write_bytes(b"x")
    busy_fd = os.open(busy, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(busy_fd, fcntl.LOCK_EX)
    try:
        server = Serve(data).wait_healthy()
        try:
            wait_for(lambda: sorted(staging_of(data).iterdir()) == [busy], "the start-up clean-up")
            assert (busy / "upload.part").read_bytes() == b"x"
            assert "leftover(s) of interrupted uploads" in server.log()
        finally:
            server.stop()
    finally:
        os.close(busy_fd)


def test_staging_is_swept_periodically(sqlite_url: str, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", database_url=sqlite_url, staging_sweep_interval_s=0.1)
    server = LiveServer(settings).start()
    try:
        area = staging_of(settings.data_dir)
        area.mkdir(parents=True, exist_ok=True)
        with staging.workspace(area) as mine:  # an upload of this process in progress
            (mine / "upload.part").write_bytes(b"in progress")
            locked = area / "u-other.0"  # one of another process
            locked.mkdir()
            fd = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                stale = area / "u-crashed.0"
                # A code package's upload interrupted the same way.
                code_stale = settings.data_dir / "code" / ".staging" / "u-crashed.0"
                code_stale.mkdir(parents=True)
                (code_stale / "upload.part").write_bytes(b"half a tarball")
                (stale / "extract-x" / "a").mkdir(parents=True)
                (stale / "extract-x" / "a" / "big.png").write_bytes(bytes(1024 * 1024))
                wait_for(lambda: not stale.exists(), "the periodic sweep")
                wait_for(lambda: not code_stale.exists(), "the clean-up of the code staging folder")
                wait_for(lambda: sorted(area.iterdir()) == sorted([mine, locked]), "the sweep to finish")
                assert (mine / "upload.part").read_bytes() == b"in progress"
            finally:
                os.close(fd)
            wait_for(lambda: not locked.exists(), "the sweep of the released folder")
            assert mine.exists()
        assert list(area.iterdir()) == []
    finally:
        server.stop()


def test_a_second_code_upload_at_once_is_refused_naming_code(tmp_path: Path) -> None:
    area = tmp_path / "code-staging"
    with (
        staging.workspace(area, owner="alice", max_per_owner=1, what="code"),
        pytest.raises(ConflictError) as refused,
        staging.workspace(area, owner="alice", what="code"),
    ):
        pass
    assert "1 code upload(s) of yours are already in progress" in refused.value.message
    assert "dataset" not in refused.value.message


# ---------------------------------------------------------------------------- serve's log


def _routine_requests(server: Serve) -> None:
    """A node registers, heartbeats and claims (nothing to claim); then a marker request."""
    with httpx.Client(base_url=server.url, headers=server.admin, timeout=30) as admin:
        worker = auth(create_token(admin, "worker"))
        node = {"name": "n1", "address": "127.0.0.1", "units": 1, "accelerator": "cpu"}
        assert admin.post("/v1/worker/nodes", json=node, headers=worker).status_code == 200
        for _ in range(3):
            r = admin.post("/v1/worker/nodes/n1/heartbeat", json={"leases": []}, headers=worker)
            assert r.status_code == 200, r.text
        r = admin.post("/v1/worker/nodes/n1/claim", params={"wait": 0}, headers=worker)
        assert r.status_code in (200, 204), r.text
        assert admin.get("/healthz").status_code == 200
        assert admin.get("/readyz").status_code == 200
        assert admin.get("/v1/whoami").status_code == 200


def test_serve_log_leaves_out_routine_lines(tmp_path: Path) -> None:
    server = Serve(tmp_path / "data").wait_healthy()
    try:
        _routine_requests(server)
    finally:
        log = server.stop()
    assert '"GET /v1/whoami HTTP/1.1" 200' in log
    assert '"POST /v1/worker/nodes HTTP/1.1" 200' in log
    assert "/heartbeat" not in log and "/claim" not in log and "/healthz" not in log, log
    assert "/readyz" not in log, log
    assert "setup plugin" not in log and "Context impl" not in log, log
    assert "Running upgrade" in log  # the migrations that ran are still named


def test_serve_debug_log_shows_everything(tmp_path: Path) -> None:
    server = Serve(tmp_path / "data", args=("--log-level", "debug")).wait_healthy()
    try:
        _routine_requests(server)
    finally:
        log = server.stop()
    assert '"POST /v1/worker/nodes/n1/heartbeat HTTP/1.1" 200' in log
    assert '"POST /v1/worker/nodes/n1/claim?wait=0 HTTP/1.1"' in log
    assert '"GET /healthz HTTP/1.1" 200' in log
    assert "setup plugin" in log and "Context impl" in log
