"""The model registry and scoring (docs/models.md), against a model really trained on digits.

One resnet18 is trained once for the module (in-process, two epochs at 32 px), its model
directory uploaded through the worker route of a job, and the job settled as succeeded.
The tests register it, score held-out digits through the API (ONNX Runtime, no torch in
the API) and compare with the model directory loaded locally with torch.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from sqlalchemy import update

from service.config import Settings
from service.db.engine import Database
from service.db.models import Job, Node
from service.services.artifacts import ModelStore
from tests.conftest import LiveServer
from tests.support.factories import auth, create_token
from tests.support.report_helpers import finish_job, start_running_job
from tests.support.trained_model import Trained
from tests.support.trainer_helpers import (
    subset_classes,
)
from tests.support.worker_fixtures import (
    start_agent,
    upload_dataset,
    wait_for_job,
    wait_for_node,
    worker_token,
)
from torchyard import modeldir
from torchyard.contract.model_archive import pack_model_dir, sha256_of
from torchyard.scoring import ONNX_TOLERANCE, OnnxModel

# A model is trained in-process once for the module.
pytestmark = pytest.mark.slow

# Scoring touches the database for one lookup: the registry tests run on both databases.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def without_onnx(trained: Trained, root: Path) -> Trained:
    """The trained model as a job leaves it when its ONNX export was dropped: no
    ``model.onnx``, no ``onnx`` entry in ``config.json``, a manifest without it."""
    folder = shutil.copytree(trained.model_dir, root / "no-onnx")
    (folder / "model.onnx").unlink()
    config = json.loads((folder / "config.json").read_text())
    config.pop("onnx", None)
    (folder / "config.json").write_text(json.dumps(config))
    listed = [line.split("  ", 1)[1] for line in (folder / "SHA256SUMS").read_text().splitlines() if line]
    (folder / "SHA256SUMS").write_text(
        "".join(f"{sha256_of(folder / name)}  {name}\n" for name in listed if name != "model.onnx")
    )
    sha256, _ = pack_model_dir(folder, root / "no-onnx.tar.gz")
    return replace(trained, model_dir=folder, archive=root / "no-onnx.tar.gz", sha256=sha256)


def succeeded_job(
    settings: Settings, admin: httpx.Client, trained: Trained, user_token: str | None = None
) -> str:
    """A user's succeeded job whose model archive is the trained one, stored as node rank
    0's upload leaves it (the upload route itself is tested in test_artifacts_api)."""
    job = start_running_job(settings, admin, per_node=1, user_token=user_token)
    store = ModelStore(settings.data_dir)
    store.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trained.archive, store.path(job.job_id))
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(
                update(Job)
                .where(Job.id == job.job_id)
                .values(model_sha256=trained.sha256, model_size=trained.archive.stat().st_size)
            )
    finally:
        db.dispose()
    finish_job(settings, job, "succeeded")
    # The job's stand-in node must not take later work (evaluations go to real agents).
    db = Database(settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.execute(update(Node).where(Node.name.in_(job.node_names)).values(status="lost"))
    finally:
        db.dispose()
    return job.job_id


@dataclass
class Env:
    server: LiveServer
    settings: Settings
    admin: httpx.Client
    user: httpx.Client
    user_token: str
    job_id: str


@pytest.fixture
def env(settings: Settings, live_server: LiveServer, trained: Trained, tmp_path: Path) -> Iterator[Env]:
    """A succeeded job of a user whose model directory is the trained one."""
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60) as admin:
        user_token = create_token(admin, "user", "alice")
        job_id = succeeded_job(settings, admin, trained, user_token)
        with httpx.Client(base_url=live_server.url, headers=auth(user_token), timeout=60) as user:
            yield Env(live_server, settings, admin, user, user_token, job_id)


def _register(client: httpx.Client, name: str, job_id: str) -> dict[str, Any]:
    r = client.post("/v1/models", json={"name": name, "job_id": job_id})
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def _predict(
    client: httpx.Client, ref: str, files: list[tuple[str, bytes]], top_k: int | str | None = None
) -> httpx.Response:
    name, _, version = ref.partition(":")
    data = {} if top_k is None else {"top_k": str(top_k)}
    return client.post(
        f"/v1/models/{name}/versions/{version or 'latest'}/predict",
        files=[("files", (filename, content, "image/png")) for filename, content in files],
        data=data,
    )


@pytest.mark.both_databases
def test_register_list_show_latest_and_delete(env: Env) -> None:
    first = _register(env.user, "digits", env.job_id)
    assert first["version"] == 1 and first["job_id"] == env.job_id
    assert first["architecture"] == "resnet18" and first["classes"] == [str(i) for i in range(10)]
    assert first["onnx"] is True and len(first["sha256"]) == 64
    job = env.user.get(f"/v1/jobs/{env.job_id}").json()
    assert first["sha256"] == job["model_sha256"]
    second = _register(env.user, "digits", env.job_id)
    assert second["version"] == 2
    _register(env.user, "other", env.job_id)

    listed = env.user.get("/v1/models").json()["items"]
    assert [(m["name"], m["latest_version"]) for m in listed] == [("digits", 2), ("other", 1)]
    shown = env.user.get("/v1/models/digits").json()
    assert [v["version"] for v in shown["versions"]] == [1, 2]
    assert env.user.get("/v1/models/digits/versions/latest").json()["version"] == 2
    assert env.user.get("/v1/models/digits/versions/1").json()["version"] == 1

    deleted = env.user.delete("/v1/models/digits/versions/2")
    assert deleted.status_code == 200, deleted.text
    assert env.user.get("/v1/models/digits/versions/2").status_code == 404
    assert env.user.get("/v1/models/digits/versions/latest").json()["version"] == 1
    # a deleted number is never given again
    assert _register(env.user, "digits", env.job_id)["version"] == 3

    bad = env.user.post("/v1/models", json={"name": "../x", "job_id": env.job_id})
    assert bad.status_code == 422 and bad.json()["code"] == "ValidationError"
    unknown = env.user.post("/v1/models", json={"name": "x", "job_id": "nope"})
    assert unknown.status_code == 404
    assert env.user.get("/v1/models/digits/versions/zero").status_code == 422
    assert env.user.get("/v1/models/nope").status_code == 404


@SQLITE_ONLY
def test_a_job_that_did_not_succeed_cannot_be_registered(env: Env) -> None:
    running = start_running_job(env.settings, env.admin, per_node=1, user_token=env.user_token)
    r = env.user.post("/v1/models", json={"name": "early", "job_id": running.job_id})
    assert r.status_code == 409 and r.json()["code"] == "ModelNotReadyError"
    onnx = env.user.get(f"/v1/jobs/{running.job_id}/model/onnx")
    assert onnx.status_code == 409 and onnx.json()["code"] == "ModelNotReadyError"
    assert running.job_id in onnx.json()["message"]


@pytest.mark.both_databases
def test_models_are_private_to_their_owner(env: Env) -> None:
    _register(env.user, "digits", env.job_id)
    other_token = create_token(env.admin, "user", "mallory")
    png = _png(Image.new("RGB", (32, 32)))
    with httpx.Client(base_url=env.server.url, headers=auth(other_token), timeout=60) as other:
        assert other.get("/v1/models").json()["items"] == []
        for path in (
            "/v1/models/digits",
            "/v1/models/digits/versions/1",
            "/v1/models/digits/versions/1/onnx",
        ):
            r = other.get(path)
            assert r.status_code == 404 and r.json()["code"] == "NotFoundError", path
        assert _predict(other, "digits:1", [("a.png", png)]).status_code == 404
        assert other.delete("/v1/models/digits/versions/1").status_code == 404
        # nor can another user register (or fetch the ONNX export of) someone else's job
        assert other.post("/v1/models", json={"name": "stolen", "job_id": env.job_id}).status_code == 404
        assert other.get(f"/v1/jobs/{env.job_id}/model/onnx").status_code == 404
        # a name of one user does not collide with the same name of another
    assert env.user.get("/v1/models/digits/versions/1").status_code == 200


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@SQLITE_ONLY
def test_predict_held_out_digits_agrees_with_the_local_loader(
    env: Env, trained: Trained, tmp_path: Path
) -> None:
    """Every held-out digit: the API's top label is the local torch loader's, the
    probabilities agree within 1e-4, and the accuracy is far above chance. Non-square
    RGBA and palette images at 224 px agree as well (resize, crop and RGB conversion)."""
    _register(env.user, "digits", env.job_id)
    local = modeldir.predict(trained.model_dir, trained.held_out, topk=3)
    served: list[dict[str, Any]] = []
    files = [(p.name, p.read_bytes()) for p in trained.held_out]
    for start in range(0, len(files), 50):
        r = _predict(env.user, "digits:latest", files[start : start + 50])
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["name"] == "digits" and body["version"] == 1
        served.extend(body["predictions"])
    assert [p["file"] for p in served] == [p.name for p in trained.held_out]
    for mine, theirs in zip(served, local, strict=True):
        assert len(mine["top"]) == 3
        assert mine["top"][0]["label"] == theirs[0][0]
        for got, (_, want) in zip(mine["top"], theirs, strict=True):
            assert abs(got["probability"] - want) <= 1e-4
    correct = sum(p["top"][0]["label"] == label for p, label in zip(served, trained.labels, strict=True))
    assert correct / len(served) >= 0.5, f"held-out accuracy {correct}/{len(served)}"

    # non-square, other modes, larger than the model's input: the same preprocessing
    digit = Image.open(trained.held_out[0]).convert("RGB")
    rgba = digit.resize((224, 150), Image.Resampling.BICUBIC).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((224, 150)))
    palette = digit.resize((150, 224), Image.Resampling.NEAREST).convert("P", palette=Image.Palette.ADAPTIVE)
    odd = [tmp_path / "rgba.png", tmp_path / "palette.png"]
    rgba.save(odd[0])
    palette.save(odd[1])
    assert [Image.open(path).mode for path in odd] == ["RGBA", "P"]
    local_odd = modeldir.predict(trained.model_dir, odd, topk=10)
    r = _predict(env.user, "digits", [(path.name, path.read_bytes()) for path in odd], top_k=10)
    assert r.status_code == 200, r.text
    for mine, theirs in zip(r.json()["predictions"], local_odd, strict=True):
        assert mine["top"][0]["label"] == theirs[0][0]
        for got, (label, want) in zip(mine["top"], theirs, strict=True):
            assert abs(got["probability"] - want) <= 1e-4, (mine["file"], label)

    # top_k is capped by the class count; one image alone works too
    one = _predict(env.user, "digits", files[:1], top_k=20).json()["predictions"]
    assert len(one) == 1 and len(one[0]["top"]) == 10
    assert abs(sum(t["probability"] for t in one[0]["top"]) - 1.0) < 1e-4


@SQLITE_ONLY
def test_onnx_downloads_match_torch(env: Env, trained: Trained, tmp_path: Path) -> None:
    """Both ONNX routes give the export; ONNX Runtime on it agrees with torch within 1e-4,
    with any batch size; config.json records the check."""
    config = json.loads((trained.model_dir / "config.json").read_text())
    assert config["onnx"]["file"] == "model.onnx" and config["onnx"]["max_abs_diff"] <= ONNX_TOLERANCE
    _register(env.user, "digits", env.job_id)
    by_job = env.user.get(f"/v1/jobs/{env.job_id}/model/onnx")
    by_version = env.user.get("/v1/models/digits/versions/1/onnx")
    assert by_job.status_code == by_version.status_code == 200
    assert by_job.content == by_version.content == (trained.model_dir / "model.onnx").read_bytes()
    assert by_job.headers["etag"].strip('"') == modeldir.sha256_file(trained.model_dir / "model.onnx")

    folder = tmp_path / "served"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(by_job.content)
    shutil.copy(trained.model_dir / "config.json", folder / "config.json")
    onnx_model = OnnxModel.load(folder)
    torch_model, _, _ = modeldir.load_model(trained.model_dir)
    images = [modeldir.load_rgb_image(p) for p in trained.held_out[:13]]
    inputs = onnx_model.preprocess(images)
    transform = modeldir.eval_transform(config)
    expected_inputs = torch.stack([transform(im) for im in images])
    assert np.array_equal(inputs, expected_inputs.numpy())
    with torch.inference_mode():
        expected = torch_model(expected_inputs).numpy()
    assert float(np.abs(onnx_model.logits(inputs) - expected).max()) <= ONNX_TOLERANCE

    # A job whose export was dropped registers (onnx: false), but neither scores nor
    # serves an ONNX file: 409, not a 5xx.
    plain = without_onnx(trained, tmp_path)
    plain_job = succeeded_job(env.settings, env.admin, plain, env.user_token)
    assert _register(env.user, "plain", plain_job)["onnx"] is False
    png = trained.held_out[0].read_bytes()
    for r in (
        _predict(env.user, "plain:1", [("a.png", png)]),
        env.user.get("/v1/models/plain/versions/1/onnx"),
        env.user.get(f"/v1/jobs/{plain_job}/model/onnx"),
    ):
        assert r.status_code == 409 and r.json()["code"] == "ModelNotReadyError", r.text
        assert "ONNX export" in r.json()["message"]


@SQLITE_ONLY
def test_numbers_in_non_ascii_digits_are_422s_not_numbers(env: Env, trained: Trained) -> None:
    """A "²" is a digit to str.isdigit() that int() refuses, a "١" (Arabic-Indic) one it
    takes: neither is a version number nor a top_k, each the 422 of any other bad value."""
    _register(env.user, "digits", env.job_id)
    good = trained.held_out[0].read_bytes()
    for text in ("\u00b2", "\u0661", "1\u00b2"):
        r = env.user.get(f"/v1/models/digits/versions/{text}")
        assert r.status_code == 422 and r.json()["details"] == {"field": "version"}, r.text
        r = _predict(env.user, f"digits:{text}", [("a.png", good)])
        assert r.status_code == 422 and r.json()["details"] == {"field": "version"}, r.text
        r = _predict(env.user, "digits:1", [("a.png", good)], top_k=text)
        assert r.status_code == 422 and r.json()["details"] == {"field": "top_k"}, r.text
    assert _predict(env.user, "digits:1", [("a.png", good)], top_k="1").status_code == 200


@SQLITE_ONLY
def test_bad_images_and_over_cap_requests_are_4xx(
    make_settings: Any, trained: Trained, tmp_path: Path
) -> None:
    settings: Settings = make_settings(
        predict_max_files=3,
        predict_max_bytes=200_000,
        predict_max_image_pixels=300 * 300,
        predict_max_total_pixels=100_000,
    )
    server = LiveServer(settings).start()
    try:
        with httpx.Client(base_url=server.url, headers=auth(server.admin_token), timeout=60) as admin:
            user_token = create_token(admin, "user", "alice")
            job_id = succeeded_job(settings, admin, trained, user_token)
            with httpx.Client(base_url=server.url, headers=auth(user_token), timeout=60) as user:
                _register(user, "digits", job_id)
                _check_refusals(user, trained)
    finally:
        server.stop()


def _check_refusals(user: httpx.Client, trained: Trained) -> None:
    good = trained.held_out[0].read_bytes()

    def refused(
        files: list[tuple[str, bytes]], status: int, code: str, top_k: int | None = None
    ) -> dict[str, Any]:
        r = _predict(user, "digits:1", files, top_k)
        assert r.status_code == status, r.text
        body: dict[str, Any] = r.json()
        assert body["code"] == code, body
        return body

    garbage = refused([("ok.png", good), ("notes.png", b"this is not an image")], 422, "ValidationError")
    assert "notes.png" in garbage["message"] and garbage["details"]["file"] == "notes.png"
    truncated = refused([("cut.png", good[: len(good) // 2])], 422, "ValidationError")
    assert "cut.png" in truncated["message"]
    big = _png(Image.new("RGB", (400, 400)))
    assert "pixels" in refused([("big.png", big)], 422, "ValidationError")["message"]
    # more images than the cap: the same 413 however many more (the parser stops at the cap)
    for count in (4, 5, 40):
        over = refused([(f"{n}.png", good) for n in range(count)], 413, "PayloadTooLargeError")
        assert "limit of 3 per request" in over["message"] and over["details"]["limit"] == 3
    # images each within the per-image cap whose pixels add up to more than the request's
    # cap: 413, read from the headers (these are small on the wire, large decoded)
    blank = _png(Image.new("RGB", (290, 290)))
    assert len(blank) < 5_000
    total = refused([("b1.png", blank), ("b2.png", blank)], 413, "PayloadTooLargeError")
    assert "100000" in total["message"] and total["details"] == {"pixels": 2 * 290 * 290, "limit": 100_000}
    # the per-image cap still comes first (400x400 is also over the request's cap)
    assert "big.png" in refused([("ok.png", good), ("big.png", big)], 422, "ValidationError")["message"]
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (290, 290, 3), dtype=np.uint8))
    heavy = _png(noise)
    assert len(heavy) > 200_000 // 2
    refused([("n1.png", heavy), ("n2.png", heavy)], 413, "PayloadTooLargeError")
    refused([("a.png", good)], 422, "ValidationError", top_k=0)
    refused([("a.png", good)], 422, "ValidationError", top_k=101)
    assert user.post("/v1/models/digits/versions/1/predict", data={"top_k": "3"}).status_code == 422
    assert user.post("/v1/models/digits/versions/1/predict", json={"files": []}).status_code == 422
    assert _predict(user, "digits:7", [("a.png", good)]).status_code == 404
    # after all that, the service still scores, up to both caps
    assert _predict(user, "digits:1", [("a.png", good)]).status_code == 200
    within = _predict(user, "digits:1", [("b1.png", blank), ("a.png", good), ("c.png", good)])
    assert within.status_code == 200, within.text
    assert [p["file"] for p in within.json()["predictions"]] == ["b1.png", "a.png", "c.png"]


@SQLITE_ONLY
def test_cli_registers_lists_predicts_and_downloads(env: Env, trained: Trained, tmp_path: Path) -> None:
    """``torchyard model register|list|show|download|delete`` and ``torchyard predict --model``
    against the service; the CLI's predictions are the API's, and the downloaded version
    loads locally."""
    cli_env = {**os.environ, "TORCHYARD_URL": env.server.url, "TORCHYARD_TOKEN": env.user_token}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "torchyard.cli", *args],
            env=cli_env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    def ok(*args: str) -> str:
        r = run(*args)
        assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    assert ok("model", "register", "digits", env.job_id).strip() == "digits:1"
    assert "digits" in ok("model", "list") and "resnet18" in ok("model", "show", "digits:1")
    images = [str(p) for p in trained.held_out[:5]]
    predicted = json.loads(ok("predict", "--model", "digits:1", *images, "--topk", "2", "--json"))
    api = _predict(env.user, "digits:1", [(Path(p).name, Path(p).read_bytes()) for p in images], top_k=2)
    # The service's shape (file, label); a local model directory's: tests/e2e/test_cli_training.py.
    assert [p["file"] for p in predicted] == images
    assert [[t["label"] for t in p["top"]] for p in predicted] == [
        [t["label"] for t in p["top"]] for p in api.json()["predictions"]
    ]
    folder = Path(ok("model", "download", "digits", "-o", str(tmp_path / "dl")).strip())
    _, classes, _ = modeldir.load_model(folder)
    assert classes == [str(i) for i in range(10)]
    # A missing image: one line, no traceback (a device the machine lacks: test_an_absent_device_*).
    missing = run("predict", str(folder), str(tmp_path / "nope.png"))
    assert missing.returncode == 1 and "no such image file" in missing.stderr
    assert "Traceback" not in missing.stderr and "InvalidDatasetError" not in missing.stderr
    onnx = Path(ok("model", "download", "digits:1", "--onnx", "-o", str(tmp_path / "m.onnx")).strip())
    assert onnx.read_bytes() == (trained.model_dir / "model.onnx").read_bytes()
    # An ordinary file, as the model directory's files are (not a private temporary's 0600).
    assert onnx.stat().st_mode & 0o777 == (folder / "config.json").stat().st_mode & 0o777
    assert ok("model", "delete", "digits:1").strip() == "deleted digits:1"
    assert json.loads(ok("model", "list", "--json")) == []


def test_an_absent_device_is_one_clear_error(trained: Trained) -> None:
    """`predict --device cuda` on a machine without a GPU: a ValueError the CLI prints as one
    line (it turns every ValueError into `error: ...`), not torch's traceback."""
    images = [trained.held_out[0]]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU that torch can use; use cpu"):
            modeldir.predict(trained.model_dir, images, device="cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="CUDA GPU"):
        modeldir.predict(trained.model_dir, images, device=f"cuda:{count}")
    with pytest.raises(ValueError, match="is not a torch device"):
        modeldir.predict(trained.model_dir, images, device="gpu")
    assert modeldir.predict(trained.model_dir, images, device="cpu")[0]


@SQLITE_ONLY
def test_evaluation_on_the_validation_set_equals_training_figures(
    env: Env, trained: Trained, tmp_path: Path
) -> None:
    """An evaluate job runs on a real worker agent; on the training job's validation set
    its top-1, top-5 and loss are the saved epoch's validation figures; per-class scores
    and the confusion matrix are consistent; a dataset with other labels is refused at
    submission naming them; a version in use by a queued evaluation cannot be deleted;
    ``torchyard evaluate MODEL DATASET`` prints the figures as a table."""
    _register(env.user, "digits", env.job_id)
    val = upload_dataset(env.user, shutil.copytree(trained.val_dir, tmp_path / "val"), "digits-val")
    fewer = subset_classes(trained.val_dir, tmp_path / "fewer", ["0", "1", "2"])
    wrong = upload_dataset(env.user, fewer, "digits-012")
    refused = env.user.post(
        "/v1/jobs", json={"type": "evaluate", "model": "digits:1", "dataset": wrong["id"]}
    )
    assert refused.status_code == 422 and refused.json()["code"] == "InvalidDatasetError"
    assert "'3'" in refused.json()["message"] and "'9'" in refused.json()["message"]
    # and a dataset with a label the model does not know is refused naming that label
    extra = shutil.copytree(trained.val_dir, tmp_path / "extra")
    shutil.copytree(extra / "0", extra / "zebra")
    unknown = upload_dataset(env.user, extra, "digits-zebra")
    refused = env.user.post(
        "/v1/jobs", json={"type": "evaluate", "model": "digits:1", "dataset": unknown["id"]}
    )
    assert refused.status_code == 422 and refused.json()["code"] == "InvalidDatasetError"
    assert "'zebra'" in refused.json()["message"] and refused.json()["details"]["unexpected"] == ["zebra"]
    assert refused.json()["details"]["missing"] == []

    # Submission checks the cluster: the agent is up first. The evaluation then needs
    # seconds (dataset and model downloads, torchrun): the delete right after finds it live.
    agent = start_agent(env.server.url, worker_token(env.admin), "evaluator", tmp_path / "agent")
    wait_for_node(env.admin, "evaluator")
    r = env.user.post("/v1/jobs", json={"type": "evaluate", "model": "digits:1", "dataset": val["id"]})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["type"] == "evaluate" and job["model"] == "digits:1" and job["dataset"] == val["id"]
    busy = env.user.delete("/v1/models/digits/versions/1")
    assert busy.status_code == 409 and job["id"] in busy.json()["message"]
    assert env.user.get(f"/v1/jobs/{job['id']}/result").status_code == 409

    try:
        done = wait_for_job(env.user, job["id"], timeout=300, agents=[agent])
        assert done["status"] == "succeeded", (done.get("failure"), agent.log_text()[-3000:])
        result = env.user.get(f"/v1/jobs/{job['id']}/result").json()
        # `torchyard evaluate MODEL DATASET` submits another evaluation, follows it and
        # prints the same figures as a table
        printed = subprocess.run(
            [sys.executable, "-m", "torchyard.cli", "evaluate", "digits:1", "digits-val", "--timeout", "300"],
            env={**os.environ, "TORCHYARD_URL": env.server.url, "TORCHYARD_TOKEN": env.user_token},
            capture_output=True, text=True, timeout=360, check=False,
        )  # fmt: skip
    finally:
        agent.discard()
    assert printed.returncode == 0, (printed.stdout, printed.stderr, agent.log_text()[-3000:])
    # While it waits, each status of the job is said (not ~35 s of silence).
    assert "  queued" in printed.stderr and "  running" in printed.stderr, printed.stderr
    lines = printed.stdout.splitlines()
    assert f"top-1 {result['top1']:.2%}" in lines[0] and f"top-5 {result['top5']:.2%}" in lines[0]
    assert lines[1].split() == ["CLASS", "PRECISION", "RECALL", "F1", "IMAGES"]
    for scores, line in zip(result["per_class"], lines[2 : 2 + len(result["per_class"])], strict=True):
        assert line.split() == [
            scores["label"],
            f"{scores['precision']:.3f}",
            f"{scores['recall']:.3f}",
            f"{scores['f1']:.3f}",
            str(scores["support"]),
        ]
    assert "confusion matrix" in printed.stdout
    best = json.loads((trained.model_dir / "metrics.json").read_text())["best"]
    assert result["num_images"] == len(list(trained.val_dir.rglob("*.png")))
    assert result["top1"] == pytest.approx(best["val.top1"], abs=1e-9)
    assert result["top5"] == pytest.approx(best["val.top5"], abs=1e-9)
    assert result["loss"] == pytest.approx(best["val.loss"], abs=1e-4)
    matrix = np.array(result["confusion_matrix"])
    assert matrix.shape == (10, 10) and matrix.sum() == result["num_images"]
    assert np.trace(matrix) / matrix.sum() == pytest.approx(result["top1"])
    for index, scores in enumerate(result["per_class"]):
        assert scores["label"] == result["classes"][index] == str(index)
        assert scores["support"] == matrix[index].sum()
        if matrix[:, index].sum():
            assert scores["precision"] == pytest.approx(matrix[index, index] / matrix[:, index].sum())
        assert scores["recall"] == pytest.approx(matrix[index, index] / matrix[index].sum())
        p, r = scores["precision"], scores["recall"]
        assert scores["f1"] == pytest.approx(0.0 if p + r == 0 else 2 * p * r / (p + r))
    # once it has ended, the version may go
    assert env.user.delete("/v1/models/digits/versions/1").status_code == 200
