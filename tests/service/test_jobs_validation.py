"""docs/datasets.md ranges: each parameter at and just beyond each bound, wrong types, unknown fields."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from tests.support.factories import create_token, insert_dataset, job_spec, register_node, token_id

EPS = 2.220446049250313e-16


@pytest.fixture
def ready(client: TestClient, settings: Settings) -> dict[str, str]:
    """A cluster of one 4-unit node and two datasets with the same labels, owned by the admin."""
    register_node(client, create_token(client, "worker"), "node-a", units=4)
    me = token_id(client, client.headers["Authorization"].split()[1])
    return {
        "train": insert_dataset(settings, me, name="train"),
        "val": insert_dataset(settings, me, name="val"),
    }


def _submit(client: TestClient, ready: dict[str, str], **overrides: Any) -> Any:
    return client.post("/v1/jobs", json=job_spec(ready["train"], ready["val"], **overrides))


def test_defaults_are_filled_and_echoed(client: TestClient, ready: dict[str, str]) -> None:
    r = _submit(client, ready)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"] == "queued"
    assert body["parameters"] == {
        "epochs": 5,
        "batch_size": 16,
        "warmup_epochs": 0,
        "learning_rate": 0.001,
        "random_seed": 1,
        "patience": 3,
        "print_frequency": 10,
        "image_size": 224,
        "augmentation": "standard",
    }
    assert body["resources"] == {
        "node_count": 1,
        "process_count_per_node": 1,
        "max_runtime_s": None,
        "max_restarts": 3,
        "hang_timeout_s": 1800,
    }
    assert body["model"] == {
        "architecture": "resnet18",
        "pretrained": False,
        "memory_efficient": False,
        "init_from_job": None,
    }
    assert [h["status"] for h in body["history"]] == ["queued"]
    assert client.get(f"/v1/jobs/{body['id']}").json()["parameters"] == body["parameters"]


@pytest.mark.both_databases
def test_a_submission_answers_the_job_as_it_is_read_back(client: TestClient, ready: dict[str, str]) -> None:
    """The 201 of a submission and of a clone is built from what the submission wrote, without
    reading it back: it is the job as ``GET /v1/jobs/{id}`` shows it (no attempt, its one
    status change), the wait reason aside, which a scheduling pass may have written since."""
    # The first job takes the node's 4 units (placed or not yet): the others keep waiting.
    assert _submit(client, ready, resources={"process_count_per_node": 4}).status_code == 201
    waiting = _submit(client, ready, name="waits", resources={"process_count_per_node": 4})
    assert waiting.status_code == 201, waiting.text
    cloned = client.post(f"/v1/jobs/{waiting.json()['id']}/clone")
    assert cloned.status_code == 201, cloned.text
    for answer in (waiting.json(), cloned.json()):
        assert answer["status"] == "queued" and answer["attempts"] == [] and answer["nodes"] == []
        assert [(h["status"], h["message"]) for h in answer["history"]] == [("queued", "submitted")]
        assert answer["history"][0]["at"] == answer["created_at"]
        read = client.get(f"/v1/jobs/{answer['id']}").json()
        assert read.keys() == answer.keys()
        assert {**read, "reason": None} == {**answer, "reason": None}


# (field, value at the bound that is accepted, value just beyond it that is refused, allowed text)
BOUNDS = [
    ("epochs", 1, 0, "> 0 and <= 2147483647"),
    ("batch_size", 1, 0, "> 0 and <= 2147483647"),
    ("warmup_epochs", 0, -1, ">= 0 and <= epochs"),
    ("learning_rate", EPS, math.nextafter(EPS, 0), ">= 2.220446049250313e-16 and finite"),
    ("random_seed", 2**63 - 1, 2**63, "a 64-bit signed integer"),
    ("random_seed", -(2**63), -(2**63) - 1, "a 64-bit signed integer"),
    ("patience", 1, 0, "> 0 and <= 2147483647"),
    ("print_frequency", 1, 0, "> 0 and <= 2147483647"),
    ("image_size", 16, 15, "16..1024"),
    ("image_size", 1024, 1025, "16..1024"),
]


@pytest.mark.both_databases
@pytest.mark.parametrize(("field", "ok", "bad", "allowed"), BOUNDS)
def test_parameter_bounds(
    client: TestClient, ready: dict[str, str], field: str, ok: Any, bad: Any, allowed: str
) -> None:
    assert _submit(client, ready, parameters={field: ok}).status_code == 201
    r = _submit(client, ready, parameters={field: bad})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "ValidationError"
    [err] = body["errors"]
    assert err["field"] == f"parameters.{field}"
    assert err["allowed"] == allowed
    assert allowed in body["message"]


@pytest.mark.parametrize(("ok", "bad"), [(1, 0), (30 * 24 * 3600, 30 * 24 * 3600 + 1)])
def test_max_runtime_bounds(client: TestClient, ready: dict[str, str], ok: int, bad: int) -> None:
    r = _submit(client, ready, resources={"max_runtime_s": ok})
    assert r.status_code == 201, r.text
    assert r.json()["resources"]["max_runtime_s"] == ok
    r = _submit(client, ready, resources={"max_runtime_s": bad})
    assert r.status_code == 422, r.text
    [err] = r.json()["errors"]
    assert err["field"] == "resources.max_runtime_s"
    assert err["allowed"] == ">= 1 and <= 2592000 (30 days), or null for no limit"
    assert _submit(client, ready, resources={"max_runtime_s": None}).status_code == 201
    assert _submit(client, ready, resources={"max_runtime_s": "soon"}).status_code == 422


def test_warmup_may_equal_but_not_exceed_epochs(client: TestClient, ready: dict[str, str]) -> None:
    assert _submit(client, ready, parameters={"epochs": 3, "warmup_epochs": 3}).status_code == 201
    r = _submit(client, ready, parameters={"epochs": 3, "warmup_epochs": 4})
    assert r.status_code == 422
    assert "warmup_epochs (4) must be <= epochs (3)" in r.json()["message"]


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_learning_rate(client: TestClient, ready: dict[str, str], bad: str) -> None:
    # Python's json module reads and writes NaN/Infinity literals; FastAPI parses them too.
    spec = job_spec(ready["train"], ready["val"], parameters={"learning_rate": "LR"})
    body = json.dumps(spec).replace('"LR"', bad)
    r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "parameters.learning_rate"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epochs", "5"),
        ("epochs", 5.5),
        ("epochs", True),
        ("batch_size", None),
        ("learning_rate", "0.1"),
        ("augmentation", "heavy"),
        ("image_size", [32]),
    ],
)
def test_wrong_types(client: TestClient, ready: dict[str, str], field: str, value: Any) -> None:
    r = _submit(client, ready, parameters={field: value})
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == f"parameters.{field}"


@pytest.mark.parametrize(
    "overrides",
    [
        {"status": "succeeded"},
        {"owner": "someone"},
        {"id": "x"},
        {"parameters": {"momentum": 0.5}},
        {"model": {"architecture": "resnet18", "weights": "x"}},
        {"resources": {"node_count": 1, "gpus": 2}},
    ],
)
def test_unknown_fields_are_refused(
    client: TestClient, ready: dict[str, str], overrides: dict[str, Any]
) -> None:
    r = _submit(client, ready, **overrides)
    assert r.status_code == 422, r.text
    err = r.json()["errors"][0]
    assert err["type"] == "extra_forbidden"
    assert err["message"].startswith("unknown field")
    assert client.get("/v1/jobs").json()["items"] == []


@pytest.mark.parametrize(
    ("overrides", "field", "suggestion"),
    [
        ({"parameters": {"epoch": 3}}, "parameters.epoch", "parameters.epochs"),
        ({"parameters": {"learningrate": 0.1}}, "parameters.learningrate", "parameters.learning_rate"),
        ({"resources": {"node_cont": 1}}, "resources.node_cont", "resources.node_count"),
        ({"modle": {"architecture": "resnet18"}}, "modle", "model"),
        ({"type": "script", "code": "x", "command": ["true"], "input": {}}, "input", "inputs"),
    ],
)
def test_an_unknown_field_names_the_field_it_most_likely_means(
    client: TestClient, ready: dict[str, str], overrides: dict[str, Any], field: str, suggestion: str
) -> None:
    """As an unknown architecture does: in the message and in the error's own fields."""
    r = _submit(client, ready, **overrides)
    assert r.status_code == 422, r.text
    body = r.json()
    err = next(e for e in body["errors"] if e["field"] == field)
    assert err["type"] == "extra_forbidden" and err["suggestion"] == suggestion
    assert err["message"] == f"unknown field {field!r}: did you mean {suggestion!r}?"
    assert f"did you mean {suggestion!r}?" in body["message"]
    # Nothing close: no guess.
    far = _submit(client, ready, parameters={"momentum": 0.9}).json()["errors"][0]
    assert far["message"] == "unknown field 'parameters.momentum'" and "suggestion" not in far


def test_unknown_architecture(client: TestClient, ready: dict[str, str]) -> None:
    r = _submit(client, ready, model={"architecture": "resnet19"})
    assert r.status_code == 422
    assert r.json()["code"] == "InvalidModelDirectoryError"
    assert "resnet19" in r.json()["message"]
    # Detection models are torchvision models, but not classifiers.
    assert _submit(client, ready, model={"architecture": "fasterrcnn_resnet50_fpn"}).status_code == 422
    assert (
        _submit(client, ready, model={"architecture": "densenet121", "memory_efficient": True}).status_code
        == 201
    )
    r = _submit(client, ready, model={"architecture": "resnet18", "memory_efficient": True})
    assert r.json()["code"] == "InvalidModelDirectoryError"


def test_init_from_job_must_be_succeeded(client: TestClient, ready: dict[str, str]) -> None:
    queued = _submit(client, ready).json()["id"]
    r = _submit(client, ready, model={"architecture": "resnet18", "init_from_job": queued})
    assert r.status_code == 422
    assert r.json()["code"] == "InvalidModelDirectoryError"
    # The app's own scheduling pass may already have placed it: any status but succeeded.
    message = r.json()["message"]
    assert "only a succeeded job has a model directory" in message
    assert any(f"is {s}" in message for s in ("queued", "scheduled", "running")), message
    r = _submit(client, ready, model={"architecture": "resnet18", "init_from_job": "nope"})
    assert r.json()["code"] == "InvalidModelDirectoryError"


def test_resource_limits_name_value_and_limit(client: TestClient, ready: dict[str, str]) -> None:
    r = _submit(client, ready, resources={"node_count": 2})
    assert r.status_code == 422
    assert r.json()["code"] == "ResourceLimitError"
    assert "node_count 2 exceeds the cluster's 1 node" in r.json()["message"]
    r = _submit(client, ready, resources={"process_count_per_node": 5})
    assert r.json()["code"] == "ResourceLimitError"
    assert (
        "process_count_per_node 5 exceeds the 4 processing units of the largest node" in r.json()["message"]
    )
    assert _submit(client, ready, resources={"process_count_per_node": 4}).status_code == 201
    r = _submit(client, ready, resources={"node_count": 0})
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "resources.node_count"


def test_max_nodes_setting_overrides_registry(make_settings: Any) -> None:
    from service.api.app import create_app

    settings = make_settings(max_nodes=3)
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        register_node(c, create_token(c, "worker"), "n1", units=2)
        me = token_id(c, c.headers["Authorization"].split()[1])
        t, v = insert_dataset(settings, me), insert_dataset(settings, me)
        assert c.post("/v1/jobs", json=job_spec(t, v, resources={"node_count": 3})).status_code == 201
        r = c.post("/v1/jobs", json=job_spec(t, v, resources={"node_count": 4}))
        assert "node_count 4 exceeds the cluster's 3 nodes" in r.json()["message"]


def test_label_mismatch_is_found_at_submission(client: TestClient, settings: Settings) -> None:
    register_node(client, create_token(client, "worker"), "node-a", units=1)
    me = token_id(client, client.headers["Authorization"].split()[1])
    train = insert_dataset(settings, me, classes=["cat", "dog", "owl"])
    val = insert_dataset(settings, me, classes=["cat", "dog", "emu"])
    r = client.post("/v1/jobs", json=job_spec(train, val))
    assert r.status_code == 422
    body = r.json()
    assert body["code"] == "InvalidDatasetError"
    assert body["details"] == {"missing_in_validation": ["owl"], "missing_in_training": ["emu"]}


def test_malformed_json_and_wrong_content(client: TestClient) -> None:
    r = client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["code"] == "ValidationError"
    r = client.post("/v1/jobs", json=[1, 2])
    assert r.status_code == 422
    r = client.get("/v1/jobs", params={"status": "sleeping"})
    assert r.status_code == 422
    r = client.get("/v1/jobs", params={"cursor": "garbage!!"})
    assert r.status_code == 422
    assert client.get("/v1/nothing-here").json()["code"] == "NotFoundError"
