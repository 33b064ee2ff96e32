"""Datasets, code packages and pretrained weights with object storage (docs/storage.md), against
the private S3 server: the client uploads straight to the bucket with a manifest the API
checks; a node fetches the archive through the API's redirect and checks it against the
manifest; the old multipart routes store into the bucket too; deletions remove the objects.

One API (uvicorn in a thread of the test process, SQLite) serves the whole module."""

from __future__ import annotations

import io
import shutil
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from service.db.engine import Database
from service.db.models import ObjectUpload
from tests.conftest import LiveServer
from tests.support.dataset_files import count_images, png_bytes, small_tree, tar_tree, zip_tree
from tests.support.factories import auth, create_token, job_spec, register_node
from tests.support.s3_server import S3Server
from torchyard.apiclient.datasets import pack_directory
from torchyard.client import Client
from torchyard.contract.dataset_digest import dataset_sha256
from torchyard.contract.errors import InvalidDatasetError
from torchyard.contract.manifests import dataset_files, dataset_manifest, folder_manifest
from torchyard.contract.transfer import describe_file
from worker.agent.dataset_cache import fetch_dataset


class Api:
    """The module's API over S3, its bucket, and clients of it."""

    def __init__(self, server: LiveServer, s3: S3Server, bucket: str) -> None:
        self.server = server
        self.settings = server.settings
        self.s3 = s3.client()
        self.bucket = bucket
        self.admin = httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=60)
        self.client = Client(server.url, server.admin_token, timeout=60)
        self.worker_token = create_token(self.admin, "worker")
        register_node(self.admin, self.worker_token, "node-a", units=64)
        self.worker = httpx.Client(base_url=server.url, headers=auth(self.worker_token), timeout=60)

    def keys(self, prefix: str = "") -> list[str]:
        found = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=f"torchyard/{prefix}")
        return sorted(o["Key"].removeprefix("torchyard/") for o in found.get("Contents", []))

    def place(self, job_id: str) -> None:
        """The job's placement moved to node-a (the worker routes check that one of the
        worker's nodes runs a job using what it fetches)."""
        from sqlalchemy import select

        from service.db.models import Node, Placement

        db = Database(self.settings.sqlalchemy_url)
        try:
            deadline = time.monotonic() + 30
            while True:
                with db.transaction() as session:
                    node = session.scalars(select(Node).where(Node.name == "node-a")).one()
                    placed = session.scalars(select(Placement).where(Placement.job_id == job_id)).all()
                    for placement in placed:
                        placement.node_id = node.id
                if placed:
                    return
                assert time.monotonic() < deadline, f"job {job_id} was never placed"
                time.sleep(0.05)
        finally:
            db.dispose()

    def uploads_left(self) -> int:
        db = Database(self.settings.sqlalchemy_url)
        try:
            with db.read_session() as session:
                return len(session.query(ObjectUpload).all())
        finally:
            db.dispose()


@pytest.fixture(scope="module")
def api(
    s3_server: S3Server, sqlite_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Api]:
    bucket = s3_server.make_bucket()
    root = tmp_path_factory.mktemp("inputs-s3")
    shutil.copyfile(sqlite_template, root / "torchyard.db")
    settings = Settings(
        data_dir=root / "data",
        database_url=f"sqlite:///{root / 'torchyard.db'}",
        storage_url=f"s3://{bucket}/torchyard",
        # The node never heartbeats: it stays ready for the module's length.
        heartbeat_interval_s=60,
        lease_timeout_s=3600,
    )
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_server.env().items():
            mp.setenv(name, value)
        server = LiveServer(settings).start()
        try:
            yield Api(server, s3_server, bucket)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def pets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_tree(tmp_path_factory.mktemp("pets") / "pets", per_class=3)


def _job_using(api: Api, dataset_id: str) -> None:
    job = api.admin.post("/v1/jobs", json=job_spec(dataset_id, dataset_id))
    assert job.status_code == 201, job.text
    api.place(job.json()["id"])


def test_a_dataset_goes_straight_to_the_bucket_and_a_node_fetches_and_checks_it(
    api: Api, pets: Path, tmp_path: Path
) -> None:
    ds = api.client.datasets.upload_dataset(pets, "pets")
    assert ds.classes == ["cat", "dog"] and ds.class_counts == {"cat": 3, "dog": 3}
    assert ds.num_images == 6 and ds.sha256 == dataset_sha256(pets)
    assert ds.size_bytes == sum(p.stat().st_size for p in pets.rglob("*.png"))
    keys = api.keys("datasets/")
    assert len(keys) == 1 and keys[0].startswith(f"datasets/{ds.sha256}/"), keys
    assert not (api.settings.data_dir / "datasets" / ds.sha256).exists()  # no copy on the API's disk
    assert api.uploads_left() == 0

    # The node's fetch follows the redirect to the bucket, extracts and checks the archive.
    url = f"/v1/worker/datasets/{ds.id}/archive"
    assert api.worker.get(url).status_code == 403  # no job of this worker uses it yet
    _job_using(api, ds.id)
    answer = api.worker.get(url)
    assert answer.status_code == 307 and answer.headers["x-torchyard-sha256"] == ds.sha256
    assert "authorization" not in answer.headers["location"].lower()
    root = fetch_dataset(api.worker, ds.id, ds.sha256, tmp_path / "cache")
    assert root == tmp_path / "cache" / ds.sha256
    assert count_images(root) == {"cat": 3, "dog": 3}
    assert dataset_sha256(root) == ds.sha256

    # The same content again is an object of its own (a direct upload is its manifest's
    # content only as far as its client says: no other upload depends on it); deleting the
    # dataset removes it.
    again = api.client.datasets.upload_dataset(pets, "pets again")
    assert again.sha256 == ds.sha256 and len(api.keys("datasets/")) == 2
    api.client.datasets.delete_dataset(again.id)
    assert api.keys("datasets/") == keys


def test_an_archive_that_is_not_its_manifest_is_refused_by_the_node(
    api: Api, pets: Path, tmp_path: Path
) -> None:
    """The API never sees a direct upload's bytes: a manifest that lies is caught where the
    archive is used, and the job fails with InvalidDatasetError naming the dataset."""
    honest = dataset_manifest(pets, dataset_files(pets))
    other = small_tree(tmp_path / "other", per_class=3)
    (other / "cat" / "0.png").write_bytes(png_bytes(seed=1234))
    archive = tmp_path / "other.tar.gz"
    with open(archive, "wb") as out:
        pack_directory(other, out)
    from torchyard.apiclient.datasets import upload_direct

    data = upload_direct(
        api.client._transport,
        "/v1/datasets/uploads",
        archive,
        fields={"name": "liar", "manifest": honest.model_dump()},
    )
    assert data["sha256"] == honest.sha256  # recorded from the manifest, as announced
    _job_using(api, data["id"])
    with pytest.raises(InvalidDatasetError, match=f"dataset {data['id']}.*checksum"):
        fetch_dataset(api.worker, data["id"], data["sha256"], tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == []

    # An archive holding one file more than its manifest is refused the same way.
    extra = tar_tree(pets, tmp_path / "extra.tar", wrap="pets")
    with tarfile.open(extra, "a") as tf:
        info = tarfile.TarInfo("pets/dog/sneaked.png")
        data_bytes = png_bytes(seed=77)
        info.size = len(data_bytes)
        tf.addfile(info, io.BytesIO(data_bytes))
    sneaky = upload_direct(
        api.client._transport,
        "/v1/datasets/uploads",
        extra,
        fields={"name": "sneaky", "manifest": honest.model_dump()},
    )
    _job_using(api, sneaky["id"])
    with pytest.raises(InvalidDatasetError, match=f"dataset {sneaky['id']}"):
        fetch_dataset(api.worker, sneaky["id"], sneaky["sha256"], tmp_path / "cache2")


def _plan(api: Api, archive: Path, manifest: dict[str, Any], name: str = "bad") -> httpx.Response:
    body = {**describe_file(archive).model_dump(exclude_none=True), "name": name, "manifest": manifest}
    return api.admin.post("/v1/datasets/uploads", json=body)


def test_a_manifest_the_layout_rules_refuse_is_a_422_at_plan_time(
    api: Api, pets: Path, tmp_path: Path
) -> None:
    archive = tmp_path / "a.tar.gz"
    with open(archive, "wb") as out:
        pack_directory(pets, out)
    good = dataset_manifest(pets, dataset_files(pets)).model_dump()
    before = api.keys("datasets/")

    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        (flat / f"{i}.png").write_bytes(png_bytes(seed=i))
    no_classes = {**folder_manifest(flat).model_dump(), "classes": [], "class_counts": {}}
    r = _plan(api, archive, no_classes)
    assert r.status_code == 422 and r.json()["code"] == "NotLabeledDatasetError", r.text

    for unsafe in ("../cat/x.png", "cat/../../x.png", "/cat/x.png", "cat/.hidden.png", "cat\\x.png"):
        bad = {**good, "files": {**good["files"], unsafe: "0" * 64}}
        r = _plan(api, archive, bad)
        assert r.status_code == 422 and r.json()["code"] == "InvalidDatasetError", (unsafe, r.text)

    not_image = {**good, "files": {**good["files"], "cat/notes.txt": "0" * 64}}
    assert _plan(api, archive, not_image).status_code == 422
    wrong_sum = {**good, "sha256": "0" * 64}
    r = _plan(api, archive, wrong_sum)
    assert r.status_code == 422 and "checksum" in r.json()["message"], r.text
    wrong_counts = {**good, "class_counts": {"cat": 3, "dog": 2}}
    assert _plan(api, archive, wrong_counts).status_code == 422
    one_class = {
        **good,
        "files": {k: v for k, v in good["files"].items() if k.startswith("cat/")},
        "classes": ["cat"],
        "class_counts": {"cat": 3},
    }
    assert _plan(api, archive, one_class).status_code == 422
    # Nothing recorded, nothing in the bucket.
    assert api.uploads_left() == 0
    assert api.keys("datasets/") == before


def test_a_client_that_can_decode_refuses_a_bad_image_before_uploading(api: Api, tmp_path: Path) -> None:
    tree = small_tree(tmp_path / "broken", per_class=2)
    (tree / "dog" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    before = api.keys("datasets/")
    with pytest.raises(InvalidDatasetError, match=r"0\.png"):
        api.client.datasets.upload_dataset(tree, "broken")
    assert api.keys("datasets/") == before and api.uploads_left() == 0


def _multipart(api: Api, archive: Path, name: str) -> dict[str, Any]:
    with open(archive, "rb") as fh:
        r = api.admin.post("/v1/datasets", data={"name": name}, files={"file": (archive.name, fh)})
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def test_the_multipart_upload_stores_the_archive_in_the_bucket_and_delete_removes_it(
    api: Api, tmp_path: Path
) -> None:
    tree = small_tree(tmp_path / "birds", classes=("owl", "tit"), per_class=2)
    archive = tar_tree(tree, tmp_path / "birds.tar.gz", mode="w:gz", wrap="birds")
    ds = _multipart(api, archive, "birds")
    assert ds["classes"] == ["owl", "tit"] and ds["sha256"] == dataset_sha256(tree)
    key = f"datasets/{ds['sha256']}.tar.gz"
    assert key in api.keys("datasets/")
    store = api.settings.data_dir / "datasets"
    assert not (store / ds["sha256"]).exists()
    assert [p.name for p in (store / ".staging").iterdir()] == []

    # An archive the API checked is shared by the uploads of the same content, multipart
    # or direct; the object goes with the last of them.
    again = _multipart(api, archive, "birds 2")
    direct = api.client.datasets.upload_dataset(tree, "birds 3")
    assert direct.sha256 == ds["sha256"]
    assert [k for k in api.keys("datasets/") if ds["sha256"] in k] == [key]
    for other in (again["id"], direct.id):
        assert api.admin.delete(f"/v1/datasets/{other}").status_code == 204
    assert key in api.keys("datasets/")
    assert api.admin.delete(f"/v1/datasets/{ds['id']}").status_code == 204
    assert key not in api.keys("datasets/")

    # A node fetches a zip stored so (no wrapping folder, hidden entries left out).
    zipped = zip_tree(tree, tmp_path / "birds.zip")
    with zipfile.ZipFile(zipped, "a") as zf:
        zf.writestr("owl/.DS_Store", b"junk")
        zf.writestr("__MACOSX/owl/._0.png", b"junk")
    ds = _multipart(api, zipped, "birds zip")
    assert f"datasets/{ds['sha256']}.zip" in api.keys("datasets/")
    _job_using(api, ds["id"])
    root = fetch_dataset(api.worker, ds["id"], ds["sha256"], tmp_path / "cache")
    assert count_images(root) == {"owl": 2, "tit": 2}
    assert sorted(p.name for p in root.iterdir()) == ["owl", "tit"]


def test_a_code_package_goes_straight_to_the_bucket_and_a_node_fetches_it(api: Api, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("print('hi')\n")
    (src / "pkg" / "util.py").write_text("X = 1\n")
    (src / ".env").write_text("SECRET=1\n")  # hidden: never part of a package
    code = api.client.code.upload_code(src, "src")
    assert code.files == 2
    keys = api.keys("code/")
    assert len(keys) == 1 and keys[0].startswith(f"code/{code.sha256}/"), keys
    assert not (api.settings.data_dir / "code" / code.sha256).exists()

    data = api.admin.get("/v1/datasets").json()["items"][0]["id"]
    job = api.admin.post(
        "/v1/jobs",
        json={"type": "script", "code": code.id, "command": ["python", "train.py"], "inputs": {"d": data}},
    )
    assert job.status_code == 201, job.text
    api.place(job.json()["id"])
    folder = fetch_dataset(
        api.worker,
        code.id,
        code.sha256,
        tmp_path / "cache",
        url=f"/v1/worker/code/{code.id}/archive",
        what=f"code package {code.id}",
        unwrap=False,
    )
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "pkg/util.py",
        "train.py",
    ]

    # A manifest naming a hidden file is refused at plan time; deleting the package (its job
    # cancelled first) removes the object.
    body = {
        **describe_file(tmp_path / "cache" / code.sha256 / "train.py").model_dump(exclude_none=True),
        "name": "bad",
        "manifest": {"sha256": "0" * 64, "num_files": 1, "size_bytes": 1, "files": {".env": "0" * 64}},
    }
    r = api.admin.post("/v1/code/uploads", json=body)
    assert r.status_code == 422 and r.json()["code"] == "InvalidCodeError", r.text
    other = api.client.code.upload_code(src / "pkg", "pkg only")
    assert len(api.keys("code/")) == 2
    assert api.admin.delete(f"/v1/code/{other.id}").status_code == 204
    assert api.keys("code/") == keys

    # The multipart route stores into the bucket too.
    legacy = code_tar(tmp_path / "legacy.tar.gz", {"main.py": b"print(1)\n"})
    with open(legacy, "rb") as fh:
        r = api.admin.post("/v1/code", data={"name": "legacy"}, files={"file": ("legacy.tar.gz", fh)})
    assert r.status_code == 201, r.text
    assert f"code/{r.json()['sha256']}.tar.gz" in api.keys("code/")


def code_tar(out: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(out, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return out


def _state_dict_file(path: Path, payload: bytes = b"weights") -> Path:
    """A file that starts as torch.save's zip archive does (the service checks no more)."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", payload)
    return path


def test_weights_go_straight_to_the_bucket_and_a_node_fetches_them(api: Api, tmp_path: Path) -> None:
    from torchyard.contract.protocol import ClaimedWeights
    from worker.agent.weights_cache import fetch_weights

    path = _state_dict_file(tmp_path / "resnet18-custom.pth")
    row = api.client.upload_weights("resnet18", path)
    assert row.sha256 == describe_file(path).sha256 and row.filename == "resnet18-custom.pth"
    key = f"weights/{row.sha256}.pth"
    assert api.keys("weights/") == [key]
    assert not (api.settings.data_dir / "weights" / f"{row.sha256}.pth").exists()
    # The same file again answers the same row, without sending it again (a plan of no parts).
    assert api.client.upload_weights("resnet18", path).id == row.id
    body = {**describe_file(path).model_dump(), "filename": path.name, "architecture": "resnet34"}
    plan = api.admin.post("/v1/weights/uploads", json=body).json()
    assert plan["mode"] == "direct" and plan["parts"] == [], plan
    # Left unfinished, the upkeep drops that upload: the stored file it named stays.
    from service.services.direct_uploads import drop_abandoned

    db = Database(api.settings.sqlalchemy_url)
    try:
        assert drop_abandoned(db, api.settings.model_copy(update={"storage_upload_expiry_s": 0})) >= 1
    finally:
        db.dispose()
    assert api.keys("weights/") == [key] and api.uploads_left() == 0

    ref = ClaimedWeights(
        id=row.id,
        architecture=row.architecture,
        filename=row.filename,
        sha256=row.sha256,
        size_bytes=row.size_bytes,
    )
    got = fetch_weights(api.worker, ref, tmp_path / "cache")
    assert got.read_bytes() == path.read_bytes()

    # A name with a torchvision hash prefix is checked against the announced sha256 at plan time.
    misnamed = _state_dict_file(tmp_path / "resnet18-0123abcd.pth", b"other")
    body = {**describe_file(misnamed).model_dump(), "filename": misnamed.name, "architecture": "resnet18"}
    r = api.admin.post("/v1/weights/uploads", json=body)
    assert r.status_code == 422 and r.json()["code"] == "InvalidModelDirectoryError", r.text

    # The multipart route stores into the bucket too; delete removes the object.
    other = _state_dict_file(tmp_path / "other.pth", b"other weights")
    with open(other, "rb") as fh:
        r = api.admin.post(
            "/v1/weights", data={"architecture": "resnet18"}, files={"file": ("other.pth", fh)}
        )
    assert r.status_code == 201, r.text
    other_key = f"weights/{r.json()['sha256']}.pth"
    assert api.keys("weights/") == sorted([key, other_key])
    for weights_id in (row.id, r.json()["id"]):
        assert api.admin.delete(f"/v1/weights/{weights_id}").status_code == 204
    assert api.keys("weights/") == []
    assert api.uploads_left() == 0
