"""Datasets over HTTP, on SQLite and PostgreSQL: uploads in every format, every attack,
size limits, ownership, deletion, path registration and the worker download."""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.config import Settings
from service.db.engine import Database
from service.db.models import Node, Placement
from tests.support.dataset_files import (
    all_files,
    count_images,
    digits_tree,
    huge_png,
    labeled_members,
    png_bytes,
    small_tree,
    tar_bomb,
    tar_tree,
    tar_with,
    truncated_png,
    zip_bomb,
    zip_tree,
    zip_with,
)
from tests.support.factories import auth, create_token, job_spec, register_node
from torchyard.contract.dataset_digest import dataset_sha256
from worker.agent.dataset_cache import fetch_dataset

FORMATS = {"zip": None, "tar": "w", "tar.gz": "w:gz", "tgz": "w:gz", "tar.bz2": "w:bz2", "tar.xz": "w:xz"}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return digits_tree(tmp_path_factory.mktemp("digits"), per_class=5)


def make_archive(src: Path, out_dir: Path, fmt: str, wrap: str | None = None) -> Path:
    out = out_dir / f"{src.name}-{wrap or 'flat'}.{fmt}"
    mode = FORMATS[fmt]
    return zip_tree(src, out, wrap=wrap) if mode is None else tar_tree(src, out, mode=mode, wrap=wrap)


def upload(client: TestClient | httpx.Client, archive: Path, name: str = "ds", **kw: Any) -> httpx.Response:
    with open(archive, "rb") as f:
        return client.post("/v1/datasets", data={"name": name}, files={"file": (archive.name, f)}, **kw)


def store(settings: Settings) -> Path:
    return settings.data_dir / "datasets"


def assert_nothing_left(settings: Settings) -> None:
    """The staging area is empty and the store holds no dataset content."""
    staging = store(settings) / ".staging"
    assert not staging.exists() or list(staging.iterdir()) == [], list(staging.iterdir())
    contents = (
        [p.name for p in store(settings).iterdir() if not p.name.startswith(".")]
        if store(settings).exists()
        else []
    )
    assert contents == [], contents


# ---------------------------------------------------------------------------- valid uploads


def test_upload_every_format_with_and_without_wrapping_folder(
    client: TestClient, settings: Settings, digits: Path, tmp_path: Path
) -> None:
    expected_sha = dataset_sha256(digits)
    expected_counts = count_images(digits)
    ids = set()
    for fmt in FORMATS:
        for wrap in (None, "digits-wrapped"):
            archive = make_archive(digits, tmp_path, fmt, wrap)
            r = upload(client, archive, name=f"digits {fmt} {wrap}")
            assert r.status_code == 201, (fmt, wrap, r.text)
            body = r.json()
            assert body["name"] == f"digits {fmt} {wrap}"
            assert body["classes"] == [str(i) for i in range(10)]
            assert body["class_counts"] == expected_counts
            assert body["num_images"] == 40
            assert body["size_bytes"] == sum(f.stat().st_size for f in digits.rglob("*.png"))
            assert body["sha256"] == expected_sha, (fmt, wrap)
            assert body["source"] == "upload" and body["path"] is None
            ids.add(body["id"])
    assert len(ids) == 12
    # Content-addressed: one stored copy for the twelve uploads of the same images.
    assert sorted(p.name for p in store(settings).iterdir() if not p.name.startswith(".")) == [expected_sha]
    assert count_images(store(settings) / expected_sha) == expected_counts
    assert list((store(settings) / ".staging").iterdir()) == []
    r = client.get(f"/v1/datasets/{body['id']}")
    assert r.status_code == 200 and r.json() == body


def test_name_defaults_to_file_name(client: TestClient, tmp_path: Path) -> None:
    archive = zip_tree(small_tree(tmp_path / "pets"), tmp_path / "my-pets.zip")
    with open(archive, "rb") as f:
        r = client.post("/v1/datasets", files={"file": ("my-pets.zip", f)})
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "my-pets"


# Class folder names that could make a label read as another one, or that no text can hold.
REFUSED_CLASS_CHARACTERS = [
    ("\u202e", "a bidirectional control character"),  # RIGHT-TO-LEFT OVERRIDE
    ("\u202a", "a bidirectional control character"),
    ("\u2067", "a bidirectional control character"),
    ("\u200f", "a bidirectional control character"),
    ("\u061c", "a bidirectional control character"),
    ("\ufffe", "a Unicode non-character"),
    ("\ufdd0", "a Unicode non-character"),
    ("\U0001ffff", "a Unicode non-character"),
    ("\u0085", "a control character"),  # a C1 control, not one of the archive's own refusals
    ("\u00ad", "a format character"),  # SOFT HYPHEN: invisible
    ("\ue000", "a private-use character"),
    ("\u0378", "an unassigned code point"),
]


@pytest.mark.parametrize(("char", "kind"), REFUSED_CLASS_CHARACTERS)
def test_class_names_with_bidi_controls_or_non_characters_are_refused(
    client: TestClient, settings: Settings, tmp_path: Path, char: str, kind: str
) -> None:
    tree = small_tree(tmp_path / "pets", classes=("cat", f"dog{char}gnp.exe"), per_class=1)
    r = upload(client, zip_tree(tree, tmp_path / "pets.zip"), name="pets")
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "InvalidDatasetError"
    code = f"U+{ord(char):04X}"
    assert r.json()["message"] == (
        f"class folder 'dog<{code}>gnp.exe' contains {code}, {kind}; rename the folder"
    )
    assert client.get("/v1/datasets").json()["items"] == []
    assert_nothing_left(settings)


def test_class_names_in_any_script_are_kept(client: TestClient, tmp_path: Path) -> None:
    # ZERO WIDTH NON-JOINER and JOINER (format characters) are part of how Persian, Indic
    # scripts and emoji are written: they do not reorder text, and stay allowed.
    classes = ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "\U0001f469\u200d\U0001f52c", "caf\u00e9")
    archive = zip_tree(small_tree(tmp_path / "scripts", classes=classes, per_class=1), tmp_path / "s.zip")
    r = upload(client, archive, name="scripts")
    assert r.status_code == 201, r.text
    assert r.json()["classes"] == sorted(classes)


@pytest.mark.both_databases
def test_list_is_paginated_newest_first(client: TestClient, tmp_path: Path) -> None:
    archive = zip_tree(small_tree(tmp_path / "pets"), tmp_path / "pets.zip")
    made = [upload(client, archive, name=f"ds{i}").json()["id"] for i in range(5)]
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = client.get("/v1/datasets", params=params).json()
        seen += [d["id"] for d in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == made[::-1]
    assert client.get("/v1/datasets", params={"cursor": "garbage"}).status_code == 422


# ---------------------------------------------------------------------------- attacks


def _attacks(tmp: Path) -> list[tuple[str, Path, str, str]]:
    """(what, archive, expected code, text the message must contain)."""
    png = png_bytes()
    out: list[tuple[str, Path, str, str]] = []

    def zipped(name: str, members: list[tuple[str, bytes]], **kw: Any) -> Path:
        return zip_with(tmp / name, members, **kw)

    base = [(n, d) for n, d, _ in labeled_members([])]
    out.append(("zip ../", zipped("z1.zip", [*base, ("../evil.png", png)]), "InvalidDatasetError", "'..'"))
    out.append(
        ("zip abs", zipped("z2.zip", [*base, ("/tmp/evil.png", png)]), "InvalidDatasetError", "absolute")
    )
    out.append(
        (
            "zip backslash",
            zipped("z3.zip", [*base, ("a\\..\\..\\evil.png", png)]),
            "InvalidDatasetError",
            "backslash",
        )
    )
    out.append(("zip drive", zipped("z4.zip", [*base, ("C:/evil.png", png)]), "InvalidDatasetError", "drive"))
    out.append(
        (
            "zip symlink",
            zipped(
                "z5.zip", [*base, ("a/l.png", b"/etc/passwd")], unix_modes={"a/l.png": stat.S_IFLNK | 0o777}
            ),
            "InvalidDatasetError",
            "symbolic link",
        )
    )
    out.append(
        (
            "tar ../",
            tar_with(tmp / "t1.tar", labeled_members([("../evil.png", png, {})])),
            "InvalidDatasetError",
            "'..'",
        )
    )
    out.append(
        (
            "tar abs",
            tar_with(tmp / "t2.tar.gz", labeled_members([("/tmp/evil.png", png, {})]), mode="w:gz"),
            "InvalidDatasetError",
            "absolute",
        )
    )
    out.append(
        (
            "tar symlink",
            tar_with(
                tmp / "t3.tar",
                labeled_members(
                    [("a/l.png", b"", {"type": tarfile.SYMTYPE, "linkname": "../../../etc/passwd"})]
                ),
            ),
            "InvalidDatasetError",
            "symbolic link",
        )
    )
    out.append(
        (
            "tar hardlink",
            tar_with(
                tmp / "t4.tar",
                labeled_members([("a/l.png", b"", {"type": tarfile.LNKTYPE, "linkname": "/etc/passwd"})]),
            ),
            "InvalidDatasetError",
            "hard link",
        )
    )
    out.append(
        (
            "tar device",
            tar_with(
                tmp / "t5.tar",
                labeled_members([("a/d.png", b"", {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3})]),
            ),
            "InvalidDatasetError",
            "device",
        )
    )
    out.append(
        ("zip bomb", zip_bomb(tmp / "bomb.zip", size=48 * 1024 * 1024), "InvalidDatasetError", "more than")
    )
    out.append(
        ("tar bomb", tar_bomb(tmp / "bomb.tgz", size=48 * 1024 * 1024), "InvalidDatasetError", "more than")
    )

    def with_image(label: str, write: Callable[[Path], Path]) -> Path:
        src = small_tree(tmp / f"tree-{label}")
        write(src / "cat" / "bad.png" if label != "text" else src / "cat" / "bad.jpg")
        return zip_tree(src, tmp / f"{label}.zip")

    out.append(("30000x30000 png", with_image("huge", huge_png), "InvalidDatasetError", "cat/bad.png"))
    out.append(("truncated png", with_image("cut", truncated_png), "InvalidDatasetError", "cat/bad.png"))
    out.append(
        (
            "text as jpg",
            with_image("text", lambda p: (p.write_text("not a jpeg"), p)[1]),
            "InvalidDatasetError",
            "cat/bad.jpg",
        )
    )
    root_images = tmp / "flat"
    root_images.mkdir()
    (root_images / "a.png").write_bytes(png)
    (root_images / "b.png").write_bytes(png)
    out.append(
        ("images at root", zip_tree(root_images, tmp / "flat.zip"), "NotLabeledDatasetError", "top level")
    )
    one = small_tree(tmp / "one", classes=("cat",))
    out.append(("one class", zip_tree(one, tmp / "one.zip"), "InvalidDatasetError", "one class"))
    junk = small_tree(tmp / "junk")
    (junk / "cat" / "notes.txt").write_text("hi")
    out.append(("non-image file", zip_tree(junk, tmp / "junk.zip"), "InvalidDatasetError", "not images"))
    notarchive = tmp / "plain.zip"
    notarchive.write_text("hello")
    out.append(("not an archive", notarchive, "InvalidDatasetError", "not a .zip"))
    return out


def test_every_attack_is_refused_and_leaves_nothing(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = make_settings(max_extracted_bytes=8 * 1024 * 1024, max_image_pixels=10_000_000)
    attacks_dir = tmp_path / "attacks"
    attacks_dir.mkdir()
    attacks = _attacks(attacks_dir)
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        before = all_files(tmp_path)
        for what, archive, code, text in attacks:
            r = upload(client, archive, name=what)
            assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
            assert r.json()["code"] == code, (what, r.text)
            assert text in r.json()["message"], (what, r.text)
            assert_nothing_left(settings)
        assert client.get("/v1/datasets").json()["items"] == []
    after = all_files(tmp_path)
    new = {p for p in after - before if not p.startswith(("data/datasets/.", "data/torchyard.db"))}
    assert new <= {"data/datasets"}, f"written outside the staging area: {sorted(new)}"
    assert not Path("/tmp/evil.png").exists()


# ---------------------------------------------------------------------------- size limits


def test_declared_oversize_upload_is_413_before_reading(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = make_settings(max_upload_bytes=64 * 1024)
    big = tmp_path / "big.zip"
    big.write_bytes(os.urandom(1024 * 1024))
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        r = upload(client, big)
        assert r.status_code == 413, r.text
        assert r.json()["code"] == "PayloadTooLargeError"
        assert_nothing_left(settings)


def _multipart_stream(size: int, sent: list[int], boundary: str = "tyboundary") -> Iterator[bytes]:
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.tar"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    chunk = b"\x00" * (256 * 1024)  # zeros: not an archive, but that is found only after the upload
    left = size
    while left > 0:
        piece = chunk[: min(left, len(chunk))]
        sent[0] += len(piece)
        left -= len(piece)
        yield piece
    yield f"\r\n--{boundary}--\r\n".encode()


def _post_stream(server_url: str, token: str, size: int, sent: list[int]) -> httpx.Response:
    with httpx.Client(base_url=server_url, headers=auth(token), timeout=120) as c:
        return c.post(
            "/v1/datasets",
            content=_multipart_stream(size, sent),
            headers={"Content-Type": "multipart/form-data; boundary=tyboundary"},
        )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def small_limit_server(make_settings: Callable[..., Settings]) -> Iterator[Any]:
    from tests.conftest import LiveServer

    server = LiveServer(make_settings(max_upload_bytes=2 * 1024 * 1024)).start()
    yield server
    server.stop()


def test_streamed_oversize_upload_is_413_and_not_read_to_the_end(small_limit_server: Any) -> None:
    """A chunked body with no Content-Length: the server counts and stops early."""
    size = 256 * 1024 * 1024
    sent = [0]
    r = _post_stream(small_limit_server.url, small_limit_server.admin_token, size, sent)
    assert r.status_code == 413, r.text
    assert r.json()["code"] == "PayloadTooLargeError"
    assert sent[0] < size // 4, f"the client could send {sent[0]} of {size} bytes"
    assert_nothing_left(small_limit_server.settings)


def test_upload_is_streamed_to_disk_not_memory(live_server: Any) -> None:
    """A 192 MiB upload under the limit: the process's memory does not grow with it."""
    import tracemalloc

    import torchvision  # noqa: F401 - imported lazily elsewhere; keep that out of the measurement

    size = 192 * 1024 * 1024
    sent = [0]
    _post_stream(live_server.url, live_server.admin_token, 1024 * 1024, [0])  # warm up
    rss_before = _rss_bytes()
    tracemalloc.start()
    try:
        r = _post_stream(live_server.url, live_server.admin_token, size, sent)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss_growth = _rss_bytes() - rss_before
    assert sent[0] == size
    assert r.status_code == 422, r.text  # the whole body was received, then found not to be an archive
    assert r.json()["code"] == "InvalidDatasetError"
    assert peak < 16 * 1024 * 1024, f"{peak / 2**20:.0f} MiB allocated at once for a {size >> 20} MiB body"
    assert rss_growth < 32 * 1024 * 1024, f"RSS grew by {rss_growth / 2**20:.0f} MiB"
    assert_nothing_left(live_server.settings)


# ---------------------------------------------------------------------------- ownership, submission, deletion


@pytest.fixture
def two_users(client: TestClient) -> dict[str, str]:
    register_node(client, create_token(client, "worker"), "node-a", units=2)
    return {"alice": create_token(client, "user", "alice"), "bob": create_token(client, "user", "bob")}


def _pets(tmp_path: Path, classes: tuple[str, ...], name: str) -> Path:
    return zip_tree(small_tree(tmp_path / name, classes=classes), tmp_path / f"{name}.zip")


def test_label_mismatch_at_submission(client: TestClient, two_users: dict[str, str], tmp_path: Path) -> None:
    h = auth(two_users["alice"])
    train = upload(client, _pets(tmp_path, ("cat", "dog", "fox"), "train"), headers=h).json()["id"]
    val = upload(client, _pets(tmp_path, ("cat", "dog", "owl"), "val"), headers=h).json()["id"]
    same = upload(client, _pets(tmp_path, ("cat", "dog", "fox"), "val2"), headers=h).json()["id"]
    r = client.post("/v1/jobs", json=job_spec(train, val), headers=h)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "InvalidDatasetError"
    assert "fox" in body["message"] and "owl" in body["message"]
    assert body["details"] == {"missing_in_validation": ["fox"], "missing_in_training": ["owl"]}
    r = client.post("/v1/jobs", json=job_spec(train, same), headers=h)
    assert r.status_code == 201, r.text


def test_other_users_dataset_is_404(client: TestClient, two_users: dict[str, str], tmp_path: Path) -> None:
    alice, bob = auth(two_users["alice"]), auth(two_users["bob"])
    ds = upload(client, _pets(tmp_path, ("cat", "dog"), "a"), headers=alice).json()["id"]
    bobs = upload(client, _pets(tmp_path, ("cat", "dog"), "b"), headers=bob).json()["id"]
    assert client.get(f"/v1/datasets/{ds}", headers=bob).status_code == 404
    assert client.get(f"/v1/datasets/{ds}", headers=bob).json()["code"] == "NotFoundError"
    assert [d["id"] for d in client.get("/v1/datasets", headers=bob).json()["items"]] == [bobs]
    for train, val, field in (
        (ds, bobs, "train_dataset"),
        (bobs, ds, "validation_dataset"),
        (ds, ds, "train_dataset"),
    ):
        r = client.post("/v1/jobs", json=job_spec(train, val), headers=bob)
        assert r.status_code == 404, r.text
        assert r.json()["code"] == "NotFoundError"
        assert r.json()["details"] == {"field": field}
        assert r.json()["message"].startswith(f"{field}: dataset {ds!r} not found")
    # Either given by name or by id, alone or both the same.
    for train, val in (("ds", bobs), (bobs, "ds"), (bobs, bobs), ("ds", "ds"), (bobs[:8], "ds")):
        r = client.post("/v1/jobs", json=job_spec(train, val), headers=bob)
        assert r.status_code == 201, r.text
        assert (r.json()["train_dataset"], r.json()["validation_dataset"]) == (bobs, bobs)
    assert client.delete(f"/v1/datasets/{ds}", headers=bob).status_code == 404
    # Still there for its owner; admin sees everything and may use any dataset.
    assert client.get(f"/v1/datasets/{ds}", headers=alice).status_code == 200
    assert client.get(f"/v1/datasets/{ds}").status_code == 200
    assert {d["id"] for d in client.get("/v1/datasets").json()["items"]} == {ds, bobs}
    assert client.post("/v1/jobs", json=job_spec(ds, bobs)).status_code == 201


def test_worker_tokens_cannot_use_user_routes(client: TestClient, tmp_path: Path) -> None:
    worker = auth(create_token(client, "worker"))
    assert upload(client, _pets(tmp_path, ("cat", "dog"), "a"), headers=worker).status_code == 403
    assert client.get("/v1/datasets", headers=worker).status_code == 403
    assert client.get("/v1/datasets", headers={"Authorization": "Bearer nope"}).status_code == 401


@pytest.mark.both_databases
def test_delete_while_in_use_is_409(
    client: TestClient, settings: Settings, two_users: dict[str, str], tmp_path: Path
) -> None:
    h = auth(two_users["alice"])
    archive = _pets(tmp_path, ("cat", "dog"), "pets")
    train = upload(client, archive, headers=h).json()
    val = upload(client, archive, name="same content", headers=h).json()
    assert train["sha256"] == val["sha256"]
    job = client.post("/v1/jobs", json=job_spec(train["id"], val["id"]), headers=h).json()
    r = client.delete(f"/v1/datasets/{train['id']}", headers=h)
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "ConflictError" and job["id"] in r.json()["message"]
    # The app's reaper pass (every second) may place the job on node-a before the cancel
    # arrives: then it is "cancelling" until the reaper sees its placement was never claimed.
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=h).json()["status"] in (
        "cancelled",
        "cancelling",
    )
    deadline = time.monotonic() + 20
    while client.get(f"/v1/jobs/{job['id']}", headers=h).json()["status"] != "cancelled":
        assert time.monotonic() < deadline, "the job did not end cancelled"
        time.sleep(0.1)
    assert client.delete(f"/v1/datasets/{train['id']}", headers=h).status_code == 204
    assert client.get(f"/v1/datasets/{train['id']}", headers=h).status_code == 404
    assert client.delete(f"/v1/datasets/{train['id']}", headers=h).status_code == 404
    # The content is shared with the other dataset: still stored until that one goes too.
    assert (store(settings) / val["sha256"]).is_dir()
    assert client.get(f"/v1/jobs/{job['id']}", headers=h).status_code == 200  # history stays readable
    assert client.delete(f"/v1/datasets/{val['id']}", headers=h).status_code == 204
    assert not (store(settings) / val["sha256"]).exists()
    assert_nothing_left(settings)
    r = client.post("/v1/jobs", json=job_spec(train["id"], val["id"]), headers=h)
    assert r.status_code == 404


# ---------------------------------------------------------------------------- registration by path


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    allowed = tmp_path / "shared" / "datasets"
    small_tree(allowed / "pets" / "wrapped")
    outside = small_tree(tmp_path / "private" / "pets")
    os.symlink(outside, allowed / "escape")
    return {"allowed": allowed, "outside": outside}


@pytest.fixture
def path_client(make_settings: Callable[..., Settings], roots: dict[str, Path]) -> Iterator[TestClient]:
    settings = make_settings(dataset_roots=[roots["allowed"]])
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        yield c


def test_register_path_inside_the_root(path_client: TestClient, roots: dict[str, Path]) -> None:
    r = path_client.post("/v1/datasets", json={"name": "pets", "path": str(roots["allowed"] / "pets")})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["source"] == "path"
    assert body["path"] == str((roots["allowed"] / "pets" / "wrapped").resolve())
    assert body["class_counts"] == {"cat": 3, "dog": 3}
    assert body["sha256"] == dataset_sha256(roots["allowed"] / "pets" / "wrapped")
    r = path_client.post(
        "/v1/datasets", json={"name": "s", "path": str(roots["allowed"] / "pets"), "sample": 2}
    )
    assert r.status_code == 201 and r.json()["sha256"] == body["sha256"]


@pytest.mark.parametrize(
    ("where", "status", "code"),
    [
        ("outside", 403, "PermissionDeniedError"),
        ("escape", 403, "PermissionDeniedError"),
        ("dotdot", 403, "PermissionDeniedError"),
        ("relative", 422, "ValidationError"),
        ("missing", 422, "InvalidDatasetError"),
    ],
)
def test_register_path_refused(
    path_client: TestClient, roots: dict[str, Path], where: str, status: int, code: str
) -> None:
    path = {
        "outside": str(roots["outside"]),
        "escape": str(roots["allowed"] / "escape"),
        "dotdot": str(roots["allowed"] / ".." / ".." / "private" / "pets"),
        "relative": "pets",
        "missing": str(roots["allowed"] / "nope"),
    }[where]
    r = path_client.post("/v1/datasets", json={"name": "x", "path": path})
    assert r.status_code == status, r.text
    assert r.json()["code"] == code


def test_register_path_with_link_escaping_inside(path_client: TestClient, roots: dict[str, Path]) -> None:
    ds = roots["allowed"] / "pets" / "wrapped"
    os.symlink(roots["outside"] / "cat" / "cat-0.png", ds / "cat" / "stolen.png")
    r = path_client.post("/v1/datasets", json={"name": "x", "path": str(ds)})
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "InvalidDatasetError" and "stolen.png" in r.json()["message"]


def test_register_path_body_is_strict(path_client: TestClient, roots: dict[str, Path]) -> None:
    r = path_client.post("/v1/datasets", json={"name": "x", "path": str(roots["allowed"]), "colour": "red"})
    assert r.status_code == 422 and r.json()["code"] == "ValidationError"
    assert "colour" in r.json()["message"]
    r = path_client.post("/v1/datasets", json={"name": "x", "path": str(roots["allowed"]), "sample": 0})
    assert r.status_code == 422
    r = path_client.post("/v1/datasets", content=b"name=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["code"] == "UnsupportedMediaTypeError"


def test_register_path_disabled_without_roots(client: TestClient, tmp_path: Path) -> None:
    r = client.post("/v1/datasets", json={"name": "x", "path": str(small_tree(tmp_path / "d"))})
    assert r.status_code == 403 and r.json()["code"] == "PermissionDeniedError"


# ---------------------------------------------------------------------------- worker download


def _place(settings: Settings, job_id: str, node_name: str) -> None:
    """The job's attempt on a node: the service's scheduling loop places a submitted job on a
    ready node at once; the placement is then moved to the node named (the route checks it)."""
    from sqlalchemy import select

    db = Database(settings.sqlalchemy_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            with db.transaction() as session:
                node = session.scalars(select(Node).where(Node.name == node_name)).one()
                placed = session.scalars(select(Placement).where(Placement.job_id == job_id)).all()
                for placement in placed:
                    placement.node_id = node.id
            if placed:
                return
            assert time.monotonic() < deadline, f"job {job_id} was never placed"
            time.sleep(0.05)
    finally:
        db.dispose()


def test_worker_downloads_verifies_and_caches(live_server: Any, digits: Path, tmp_path: Path) -> None:
    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60)
    worker_token = create_token(admin, "worker")
    other_worker = create_token(admin, "worker")
    register_node(admin, worker_token, "node-a", units=2)
    register_node(admin, other_worker, "node-b", units=2)
    ds = upload(admin, make_archive(digits, tmp_path, "tar.gz", wrap="w")).json()
    wc = httpx.Client(base_url=live_server.url, headers=auth(worker_token), timeout=60)
    url = f"/v1/worker/datasets/{ds['id']}/archive"
    assert wc.get(url).status_code == 403  # no job of this worker uses it yet
    job = admin.post("/v1/jobs", json=job_spec(ds["id"], ds["id"])).json()
    _place(live_server.settings, job["id"], "node-a")
    assert admin.get(url).status_code == 403  # not a worker token
    assert httpx.get(live_server.url + url, headers=auth(other_worker)).status_code == 403
    first = wc.get(url)
    assert first.status_code == 200
    assert first.headers["x-torchyard-sha256"] == ds["sha256"]
    assert int(first.headers["content-length"]) == len(first.content)
    assert wc.get(url).content == first.content  # deterministic

    cache = tmp_path / "cache"
    root = fetch_dataset(wc, ds["id"], ds["sha256"], cache)
    assert root == cache / ds["sha256"]
    assert count_images(root) == count_images(digits)
    assert dataset_sha256(root) == ds["sha256"]
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [ds["sha256"]]
    assert list((cache / ".staging").iterdir()) == []

    # Cached: a second fetch does not download again (a client that cannot connect still works).
    offline = httpx.Client(base_url="http://127.0.0.1:9", timeout=1)
    assert fetch_dataset(offline, ds["id"], ds["sha256"], cache) == root

    # A wrong expected checksum is refused and nothing is cached.
    from torchyard.contract.errors import InvalidDatasetError

    with pytest.raises(InvalidDatasetError):
        fetch_dataset(wc, ds["id"], "f" * 64, tmp_path / "cache2")
    assert [p.name for p in (tmp_path / "cache2").iterdir() if not p.name.startswith(".")] == []

    # Tampered content on the server side: the worker's recomputed checksum catches it.
    stored = live_server.settings.data_dir / "datasets" / ds["sha256"]
    victim = next(iter(sorted((stored / "3").iterdir())))
    os.chmod(victim, 0o644)
    victim.write_bytes(png_bytes(size=32, seed=99))
    with pytest.raises(InvalidDatasetError, match="checksum"):
        fetch_dataset(wc, ds["id"], ds["sha256"], tmp_path / "cache3")
    assert [p.name for p in (tmp_path / "cache3").iterdir() if not p.name.startswith(".")] == []
    assert list((tmp_path / "cache3" / ".staging").iterdir()) == []
    shutil.rmtree(tmp_path / "cache3")
    for c in (admin, wc, offline):
        c.close()


@pytest.mark.both_databases
def test_concurrent_fetchers_share_one_copy(live_server: Any, digits: Path, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    admin = httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60)
    worker_token = create_token(admin, "worker")
    register_node(admin, worker_token, "node-a", units=2)
    ds = upload(admin, make_archive(digits, tmp_path, "zip")).json()
    job = admin.post("/v1/jobs", json=job_spec(ds["id"], ds["id"])).json()
    _place(live_server.settings, job["id"], "node-a")
    cache = tmp_path / "cache"

    def fetch(_: int) -> Path:
        with httpx.Client(base_url=live_server.url, headers=auth(worker_token), timeout=60) as c:
            return fetch_dataset(c, ds["id"], ds["sha256"], cache)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(fetch, range(4)))
    assert set(results) == {cache / ds["sha256"]}
    assert dataset_sha256(results[0]) == ds["sha256"]
    assert list((cache / ".staging").iterdir()) == []
    admin.close()


def test_a_tar_with_class_folders_not_in_utf8_is_refused_and_the_list_still_answers(
    client: TestClient, tmp_path: Path
) -> None:
    archive = tmp_path / "latin1.tar"
    with tarfile.open(
        archive, "w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape"
    ) as tf:
        for n, folder in enumerate((b"caf\xe9", b"th\xe9")):  # Latin-1 bytes, not UTF-8
            for i in range(2):
                data = png_bytes(seed=n * 10 + i)
                info = tarfile.TarInfo(f"{folder.decode('utf-8', 'surrogateescape')}/{i}.png")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    r = upload(client, archive, name="latin1")
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "InvalidDatasetError" and "not valid UTF-8" in r.json()["message"]
    listed = client.get("/v1/datasets")
    assert listed.status_code == 200 and [d["name"] for d in listed.json()["items"]] == []
    assert client.get("/v1/datasets/caf").status_code == 404
