"""The finetune-resnet example as a script job on the demo's digits, and its model directory
registered from the job's outputs (docs/script-jobs.md, §10: ``POST /v1/models {name, job_id, path}``).

One real job (two processes, one epoch at 32 px) serves every assertion: the example's
metrics and outputs, refused paths (each a 4xx naming ``path``), the registered version
scored by the service and compared with the same directory downloaded by
``torchyard model download`` and loaded locally with torch, its ONNX export, one model
directory per script job, and another user's 404.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.e2e.test_script_jobs import SCRIPT_SETTINGS
from tests.support import REPO_ROOT
from tests.support.factories import auth, create_token, job_spec
from tests.support.script_helpers import ScriptEnv, script_env
from tests.support.worker_fixtures import upload_digits
from torchyard import modeldir
from torchyard.sample_data import write_digits

ROOT = REPO_ROOT
# Runs the example unchanged, then (rank 0) leaves damaged copies of its model directory
# beside it in the outputs, for the registration's refusals.
WRAPPER = textwrap.dedent(
    """
    import json, os, runpy, shutil, sys
    from torchyard import modeldir, run

    sys.argv = ["train.py", *sys.argv[1:]]
    runpy.run_path("train.py", run_name="__main__")
    if os.environ.get("RANK", "0") == "0":
        out = run.output_dir()
        def copy(name):
            shutil.copytree(out / "model", out / name)
            return out / name
        (copy("no-manifest") / "SHA256SUMS").unlink()
        (copy("unlisted") / "notes.txt").write_text("not in the manifest")
        bad = copy("bad-config")
        config = json.loads((bad / "config.json").read_text())
        config["image_size"] = "large"
        (bad / "config.json").write_text(json.dumps(config))
        modeldir.write_manifest(bad, ["config.json", "model.safetensors", "metrics.json", "model.onnx"])
        other = copy("other")
        (other / "metrics.json").write_text("{}")
        modeldir.write_manifest(other, ["config.json", "model.safetensors", "metrics.json", "model.onnx"])
        # Hostile model directories (small: config.json, stand-in weights, and model.onnx): a
        # Loop, a 1 GiB ConstantOfShape, and an image_size of 4096.
        import onnx
        from tests_onnx_attacks import constant_of_shape_model, loop_model, plain_model
        config = json.loads((out / "model" / "config.json").read_text())
        for name, model, size in (("loop", loop_model(), 32), ("constant-of-shape", constant_of_shape_model(), 32),
                                  ("upscaler", plain_model(), 4096)):
            hostile = out / name
            hostile.mkdir()
            (hostile / "config.json").write_text(json.dumps({**config, "image_size": size}))
            (hostile / "model.safetensors").write_bytes(b"stand-in")
            (hostile / "metrics.json").write_text("{}")
            onnx.save(model, str(hostile / "model.onnx"))
            modeldir.write_manifest(hostile, ["config.json", "model.safetensors", "metrics.json", "model.onnx"])
    """
)
ATTACKS = (ROOT / "tests" / "support" / "onnx_attacks.py").read_text()
MODEL_FILES = {"config.json", "model.safetensors", "metrics.json", "model.onnx", "SHA256SUMS"}


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    settings: Settings = make_settings(**SCRIPT_SETTINGS)
    return settings


@pytest.fixture
def env(settings: Settings, tmp_path: Path) -> Iterator[ScriptEnv]:
    with script_env(settings, tmp_path) as e:
        yield e


def _pack(folder: Path, extra: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for path in sorted(folder.iterdir()):
            if path.is_file():
                tf.add(path, arcname=path.name)
        for name, text in extra.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def _register(
    client: httpx.Client, job_id: str, path: str | None, name: str = "digits-finetune"
) -> httpx.Response:
    body: dict[str, Any] = {"name": name, "job_id": job_id}
    if path is not None:
        body["path"] = path
    return client.post("/v1/models", json=body)


def _refused(r: httpx.Response, status: int, text: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["details"]["field"] == "path", body
    assert text in body["message"], body


def test_finetune_example_trains_and_registers_from_its_outputs(env: ScriptEnv, tmp_path: Path) -> None:
    env.agent("solo", slots=2)
    train, val = upload_digits(env.user, tmp_path / "digits", per_class=8, size=32)
    folder = ROOT / "examples" / "finetune-resnet"
    r = env.user.post(
        "/v1/code",
        data={"name": "finetune-resnet"},
        files={
            "file": (
                "finetune-resnet.tar.gz",
                _pack(folder, {"wrapper.py": WRAPPER, "tests_onnx_attacks.py": ATTACKS}),
                "application/gzip",
            )
        },
    )
    assert r.status_code == 201, r.text
    command = ["python", "wrapper.py", "--num_epochs", "1", "--image_size", "32", "--batch_size", "8",
               "--arch", "resnet18"]  # fmt: skip
    job_id = env.submit(
        r.json()["id"],
        command,
        inputs={"train": train, "val": val},
        resources={"node_count": 1, "process_count_per_node": 2},
    )
    job = env.wait(job_id, timeout=300)
    assert job["status"] == "succeeded", (job, env.log(job_id, rank=0))
    names = {p["name"] for p in env.user.get(f"/v1/jobs/{job_id}/metrics").json()["items"]}
    assert {"train.loss", "val.top1", "val.loss", "train.images_per_sec"} <= names
    outputs = env.outputs(job_id)
    assert {"model.pt", "classes.json"} | {f"model/{n}" for n in MODEL_FILES} <= set(outputs)
    assert outputs["classes.json"] == b'["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]'

    # Refusals, each naming path: a script job needs one; it must be a folder inside the
    # outputs holding a model directory.
    _refused(_register(env.user, job_id, None), 422, "name the folder of its outputs")
    _refused(_register(env.user, job_id, "nope"), 404, "no folder 'nope'")
    _refused(_register(env.user, job_id, "../model"), 422, "not a relative path")
    _refused(_register(env.user, job_id, "/model"), 422, "not a relative path")
    _refused(_register(env.user, job_id, "model.pt"), 422, "is a file")
    _refused(_register(env.user, job_id, "no-manifest"), 422, "no SHA256SUMS manifest")
    _refused(_register(env.user, job_id, "unlisted"), 422, "notes.txt")
    bad_config = _register(env.user, job_id, "bad-config")
    _refused(bad_config, 422, "image_size")
    assert bad_config.json()["code"] == "InvalidModelDirectoryError"
    # The API would score these: refused before anything is stored, naming what is wrong.
    _refused(_register(env.user, job_id, "loop"), 422, "'Loop'")
    _refused(_register(env.user, job_id, "constant-of-shape"), 422, "'ConstantOfShape'")
    _refused(
        _register(env.user, job_id, "upscaler"),
        422,
        "image_size must be a whole number of pixels from 16 to 1024",
    )
    assert env.user.get(f"/v1/jobs/{job_id}").json()["model_sha256"] is None  # nothing stored

    # Another user cannot register it; a training job takes no path.
    with httpx.Client(base_url=env.server.url, headers=auth(env.server.admin_token)) as admin:
        other_token = create_token(admin, "user", "mallory")
    with httpx.Client(base_url=env.server.url, headers=auth(other_token), timeout=60) as other:
        stolen = _register(other, job_id, "model")
        assert stolen.status_code == 404 and stolen.json()["code"] == "NotFoundError", stolen.text
    training = env.user.post("/v1/jobs", json=job_spec(train, val, name="plain"))
    assert training.status_code == 201, training.text
    env.user.post(f"/v1/jobs/{training.json()['id']}/cancel")
    _refused(_register(env.user, training.json()["id"], "model"), 422, "training job")

    first = _register(env.user, job_id, "./model/")
    assert first.status_code == 201, first.text
    version = first.json()
    assert (version["version"], version["job_id"], version["path"]) == (1, job_id, "model")
    assert version["architecture"] == "resnet18" and version["classes"] == [str(i) for i in range(10)]
    assert version["image_size"] == 32 and version["onnx"] is True
    assert env.user.get(f"/v1/jobs/{job_id}").json()["model_sha256"] == version["sha256"]
    # Again, from the command line: the same folder gives another version of the same content.
    token = env.user.headers["Authorization"].split()[1]
    cli_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    cli_env.update(TORCHYARD_URL=env.server.url, TORCHYARD_TOKEN=token)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "torchyard.cli", *args],
            env=cli_env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    again = cli("model", "register", "digits-finetune", "--job", job_id, "--path", "model")
    assert again.returncode == 0 and again.stdout.strip() == "digits-finetune:2", again.stderr
    assert "outputs folder model" in again.stderr
    assert env.user.get("/v1/models/digits-finetune/versions/2").json()["sha256"] == version["sha256"]
    clash = _register(env.user, job_id, "other")
    assert clash.status_code == 409 and clash.json()["details"]["registered"] == "model", clash.text
    shown = env.user.get("/v1/models/digits-finetune/versions/1").json()
    assert shown["path"] == "model" and shown["job_id"] == job_id

    # The service's predictions are the downloaded model directory's, loaded with torch.
    done = cli("model", "download", "digits-finetune:1", "-o", str(tmp_path / "dl"))
    assert done.returncode == 0, done.stderr
    local_dir = modeldir.resolve_model_dir(tmp_path / "dl")
    modeldir.verify_model_dir(local_dir)
    more_train, _ = write_digits(tmp_path / "more", per_class=4, size=32)
    images = sorted(more_train.rglob("*.png"))[::4][:8]
    assert len(images) == 8
    local = modeldir.predict(local_dir, images, topk=3)
    r = env.user.post(
        "/v1/models/digits-finetune/versions/1/predict",
        files=[("files", (p.name, p.read_bytes(), "image/png")) for p in images],
        data={"top_k": "3"},
    )
    assert r.status_code == 200, r.text
    served = r.json()["predictions"]
    assert [s["file"] for s in served] == [p.name for p in images]
    for mine, theirs in zip(local, served, strict=True):
        assert [label for label, _ in mine] == [t["label"] for t in theirs["top"]]
        for (_, p), t in zip(mine, theirs["top"], strict=True):
            assert abs(p - t["probability"]) <= 1e-4
    onnx = env.user.get("/v1/models/digits-finetune/versions/1/onnx")
    assert onnx.status_code == 200
    assert hashlib.sha256(onnx.content).hexdigest() == modeldir.sha256_file(local_dir / "model.onnx")
