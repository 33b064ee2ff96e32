"""Bad input is a 4xx that names the problem, never a 5xx: text that is not Unicode,
integers past what the database holds, dataset paths the service may not read, typos and
malformed JSON; a client that goes away mid-upload is an ordinary event; the API docs
work offline and know the bearer scheme."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from service.api.app import create_app
from service.api.errors import ErrorResponse
from service.api.files import parse_range, refuse_oversized
from service.config import Settings
from service.engines.slurm_cli import Slurm, parse_sinfo
from service.services.datasets import staging_dir
from tests.conftest import LiveServer
from tests.support.dataset_files import small_tree
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id
from torchyard.contract.reports import file_stream_node_rank

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
SURROGATE_MESSAGE = "text holds a lone UTF-16 surrogate"


@pytest.fixture
def job_id(client: TestClient, settings: Settings) -> str:
    """A job of the admin's that stays queued: the one node's one unit goes to the job before it."""
    register_node(client, create_token(client, "worker"), "node-a", units=1)
    me = token_id(client, client.headers["Authorization"].split()[1])
    train, val = insert_dataset(settings, me, name="train"), insert_dataset(settings, me, name="val")
    assert client.post("/v1/jobs", json=job_spec(train, val, name="first")).status_code == 201
    r = client.post("/v1/jobs", json=job_spec(train, val))
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "queued"
    value: str = r.json()["id"]
    return value


def _post_raw(client: TestClient, url: str, body: bytes, headers: dict[str, str] | None = None) -> Any:
    return client.post(url, content=body, headers={"Content-Type": "application/json", **(headers or {})})


# ---------------------------------------------------------------------------- lone surrogates

# (route, token role, raw JSON body, the field the answer must name)
SURROGATE_BODIES = [
    (
        "/v1/jobs",
        "admin",
        b'{"name": "\\ud800", "model": {"architecture": "resnet18"}, "train_dataset": "a", '
        b'"validation_dataset": "b"}',
        "name",
    ),
    ("/v1/datasets", "admin", b'{"name": "\\ud800", "path": "/srv/data"}', "name"),
    ("/v1/tokens", "admin", b'{"name": "\\ud800", "role": "user"}', "name"),
    ("/v1/tokens", "admin", b'{"name": "t", "role": "user", "\\udc00": 1}', "\\udc00"),
    (
        "/v1/worker/nodes",
        "worker",
        b'{"name": "n1", "address": "10.0.0.1", "units": 1, "info": {"host": "a\\ud800b"}}',
        "info.host",
    ),
    ("/v1/worker/nodes/n1/heartbeat", "worker", b'{"leases": ["\\udbff"]}', "leases.0"),
    (
        "/v1/worker/placements/status",
        "worker",
        b'{"state": "failed", "failure": {"code": "X", "message": "\\ud800"}}',
        "failure.message",
    ),
    (
        "/v1/worker/jobs/j1/reports",
        "worker",
        b'{"logs": [{"stream": "rank-0", "offset": 0, "data": "\\udfff"}]}',
        "logs.0.data",
    ),
]


@pytest.mark.both_databases
@pytest.mark.parametrize(("url", "role", "body", "field"), SURROGATE_BODIES)
def test_lone_surrogate_is_a_422_naming_the_field(
    client: TestClient, url: str, role: str, body: bytes, field: str
) -> None:
    headers = auth(create_token(client, "worker")) if role == "worker" else None
    r = _post_raw(client, url, body, headers)
    assert r.status_code == 422, r.text
    answer = r.json()  # the body itself is valid UTF-8 JSON
    assert answer["code"] == "ValidationError"
    assert f"{field}: {SURROGATE_MESSAGE}" in answer["message"]
    assert "\\u" in answer["message"]


@pytest.mark.both_databases
def test_surrogate_pair_is_ordinary_text(client: TestClient) -> None:
    r = _post_raw(client, "/v1/tokens", b'{"name": "rocket \\ud83d\\ude80", "role": "user"}')
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "rocket \U0001f680"


def test_error_bodies_escape_text_utf8_cannot_carry() -> None:
    body = ErrorResponse({"code": "X", "message": "bad \ud800", "details": {"\udc00": ["\ud800"]}}).body
    assert (
        body.decode("utf-8") == '{"code":"X","message":"bad \\\\ud800","details":{"\\\\udc00":["\\\\ud800"]}}'
    )


# ---------------------------------------------------------------------------- integer bounds


def _integer_schemas(schema: Any) -> Iterator[dict[str, Any]]:
    if isinstance(schema, dict):
        if schema.get("type") == "integer" or schema.get("type") == "number":
            yield schema
        for value in schema.values():
            yield from _integer_schemas(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _integer_schemas(value)


def test_every_numeric_parameter_has_an_upper_bound(client: TestClient) -> None:
    """Unbounded integers reach SQL and overflow its 64-bit columns: each query, path and
    header parameter of every route declares a maximum."""
    spec = client.get("/openapi.json").json()
    checked = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for param in operation.get("parameters", []):
                for schema in _integer_schemas(param["schema"]):
                    checked.append(f"{method} {path} {param['name']}")
                    assert "maximum" in schema or "exclusiveMaximum" in schema, checked[-1]
    assert "get /v1/jobs/{job_id}/metrics after" in checked


# (route under the job, parameter, largest accepted value, smallest refused value)
INTEGER_QUERY_BOUNDS = [
    ("/metrics", "after", INT64_MAX, INT64_MAX + 1),
    ("/metrics", "limit", 10_000, 10_001),
    ("/logs", "rank", 1_000_000, 1_000_001),
    ("/logs", "offset", 2**62, 2**62 + 1),
    ("/logs", "limit_bytes", 16 << 20, (16 << 20) + 1),
    ("/logs", "attempt", INT32_MAX, INT32_MAX + 1),
    ("/logs/streams", "attempt", INT32_MAX, INT32_MAX + 1),
    ("", "limit", 200, 201),  # GET /v1/jobs?limit=
]


@pytest.mark.both_databases
@pytest.mark.parametrize(("route", "param", "largest", "refused"), INTEGER_QUERY_BOUNDS)
def test_integer_query_parameters_are_bounded(
    client: TestClient, job_id: str, route: str, param: str, largest: int, refused: int
) -> None:
    url = f"/v1/jobs/{job_id}{route}" if route else "/v1/jobs"
    ok = client.get(url, params={param: largest})
    assert ok.status_code < 500, ok.text
    assert ok.status_code != 422 or all(e["field"] != param for e in ok.json().get("errors", [])), ok.text
    for bad in (refused, 2**64, 10**30):
        r = client.get(url, params={param: bad})
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["field"] == param


@pytest.mark.both_databases
def test_metrics_cursor_at_the_64_bit_limit_reads_sql(client: TestClient, job_id: str) -> None:
    r = client.get(f"/v1/jobs/{job_id}/metrics", params={"after": INT64_MAX})
    assert r.status_code == 200, r.text
    assert r.json() == {"items": [], "next_after": INT64_MAX}
    r = client.get(f"/v1/jobs/{job_id}/metrics", params={"after": INT64_MAX + 1})
    assert r.status_code == 422
    assert "less than or equal to 9223372036854775807" in r.json()["message"]


def test_dataset_list_limit_is_bounded(client: TestClient) -> None:
    assert client.get("/v1/datasets", params={"limit": 200}).status_code == 200
    for bad in (201, INT64_MAX + 1):
        r = client.get("/v1/datasets", params={"limit": bad})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "limit"


@pytest.mark.parametrize("wait", ["3601", "1e999", "nan", "inf", str(INT64_MAX + 1)])
def test_claim_wait_is_bounded(client: TestClient, wait: str) -> None:
    worker = create_token(client, "worker")
    register_node(client, worker, "node-b", units=1)
    r = client.post("/v1/worker/nodes/node-b/claim", params={"wait": wait}, headers=auth(worker))
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "wait"


def test_event_ranks_and_resume_cursor_are_bounded(client: TestClient, job_id: str) -> None:
    url = f"/v1/jobs/{job_id}/events"
    r = client.get(url, params={"rank": 1_000_001})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "rank.0"
    for cursor in (f"s0.m{INT64_MAX + 1}.l0", "s9999999999999999999.m0.l0"):
        r = client.get(url, params={"resume": cursor})
        assert r.status_code == 422, r.text
        assert "not an event id" in r.json()["message"]
        r = client.get(url, headers={"Last-Event-ID": cursor})
        assert r.status_code == 422, r.text
    # At the limit the cursor is accepted: the cancelled job's stream ends at once.
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    with client.stream("GET", url, params={"resume": f"s{INT64_MAX}.m{INT64_MAX}.l{INT64_MAX}"}) as r:
        assert r.status_code == 200
        assert "event: end" in r.read().decode()


@pytest.mark.parametrize("header", ["bytes=\u00b2-", "bytes=-\u00b3", "bytes=0-\u00b9"])
def test_range_header_with_non_ascii_digits_is_ignored(header: str) -> None:
    # "²".isdigit() is true but int("²") fails: such a header is not a range of this server.
    assert parse_range(header, 100) is None


# ², an Arabic-Indic one, a mathematical bold one, and a number ending in ²: each is a
# "digit" to str.isdigit() (int() refuses the first and the last, takes the others); none
# is a number to this API.
NON_ASCII_NUMBERS = ["\u00b2", "\u0661", "\U0001d7cf", "1\u00b2"]


@pytest.mark.parametrize("version", NON_ASCII_NUMBERS)
def test_model_version_in_non_ascii_digits_is_the_422_of_any_bad_version(
    client: TestClient, version: str
) -> None:
    user = auth(create_token(client, "user"))
    expected = client.get("/v1/models/digits/versions/zero", headers=user)
    assert expected.status_code == 422, expected.text
    for method, suffix in (("GET", ""), ("DELETE", ""), ("GET", "/onnx")):
        r = client.request(method, f"/v1/models/digits/versions/{version}{suffix}", headers=user)
        assert r.status_code == 422, (method, suffix, r.text)
        assert r.json()["details"] == expected.json()["details"] == {"field": "version"}
        assert r.json()["message"].startswith("version must be a positive number or 'latest'")


@pytest.mark.parametrize("length", ["\u00b2", "\u00b9\u00b2"])
def test_content_length_in_non_ascii_digits_is_not_a_declared_length(length: str) -> None:
    scope = {"type": "http", "headers": [(b"content-length", length.encode("latin-1"))]}
    refuse_oversized(Request(scope), 10, "an upload")  # no declared length: nothing to refuse


@pytest.mark.parametrize("stream", [f"file-{n}/train.log" for n in NON_ASCII_NUMBERS])
def test_file_stream_with_a_non_ascii_node_rank_is_not_a_file_stream(stream: str) -> None:
    assert file_stream_node_rank(stream) is None
    assert file_stream_node_rank("file-1/train.log") == 1


@pytest.mark.parametrize("length", ["\u00b2", "\u00b9\u00b2"])
def test_report_batch_with_a_non_ascii_content_length_is_read(length: str) -> None:
    from service.api.routes.reports import _CappedRequest

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "headers": [(b"content-length", length.encode("latin-1"))]}
    assert asyncio.run(_CappedRequest(scope, receive).body()) == b"{}"


@pytest.mark.parametrize("value", NON_ASCII_NUMBERS)
def test_slurm_numbers_in_non_ascii_digits_are_not_numbers(value: str) -> None:
    (node,) = parse_sinfo(f"n1|idle|gpu:1|{value}|10.0.0.1|batch*")
    assert node.cpus == 1
    slurm = Slurm()
    slurm.run = lambda argv, **_: f"PartitionName=batch GraceTime={value}"  # type: ignore[method-assign]
    assert slurm.partition_grace_s("batch") is None


# ---------------------------------------------------------------------------- dataset paths


@pytest.fixture
def rooted(make_settings: Callable[..., Settings], tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    root = tmp_path / "shared"
    small_tree(root / "pets")
    settings = make_settings(dataset_roots=[root])
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {settings.admin_token_path.read_text().strip()}"
        yield c, root


@pytest.mark.parametrize("path", ["/proc/1/cwd", "/proc/1/cwd/data", "/proc/1/root"])
def test_unreadable_link_is_a_403(rooted: tuple[TestClient, Path], path: str) -> None:
    """The service may not read the link (permission denied) or it leads outside the roots:
    either way a 403 that names only the path sent."""
    client, _ = rooted
    r = client.post("/v1/datasets", json={"name": "p", "path": path})
    assert r.status_code == 403, r.text
    assert r.json()["code"] == "PermissionDeniedError"
    assert repr(path) in r.json()["message"]


def test_refused_path_message_does_not_reveal_where_links_lead(
    rooted: tuple[TestClient, Path], tmp_path: Path
) -> None:
    client, root = rooted
    secret = small_tree(tmp_path / "private-area-7f3a" / "pets")
    os.symlink(secret, root / "escape")
    sent = str(root / "escape")
    r = client.post("/v1/datasets", json={"name": "p", "path": sent})
    assert r.status_code == 403, r.text
    assert r.json()["code"] == "PermissionDeniedError"
    assert repr(sent) in r.json()["message"]
    assert "private-area-7f3a" not in r.text
    assert r.json()["details"] == {"allowed_roots": [str(root)]}


def test_symlink_loop_and_nul_are_4xx(rooted: tuple[TestClient, Path]) -> None:
    client, root = rooted
    os.symlink(root / "loop-b", root / "loop-a")
    os.symlink(root / "loop-a", root / "loop-b")
    r = client.post("/v1/datasets", json={"name": "p", "path": str(root / "loop-a")})
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "InvalidDatasetError"
    assert "symbolic link loop" in r.json()["message"]
    r = client.post("/v1/datasets", json={"name": "p", "path": str(root / "pets") + "\x00x"})
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "ValidationError" and "NUL" in r.json()["message"]


# ---------------------------------------------------------------------------- client gone mid-upload


def _staged_uploads(settings: Settings) -> list[Path]:
    """What uploads in progress hold in the staging area (their files or folders)."""
    staging = staging_dir(settings)
    return sorted(staging.iterdir()) if staging.is_dir() else []


def test_client_gone_mid_upload_is_one_info_line(
    live_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="service")
    head = (
        "POST /v1/datasets HTTP/1.1\r\n"
        f"Host: {live_server.host}:{live_server.port}\r\n"
        f"Authorization: Bearer {live_server.admin_token}\r\n"
        "Content-Type: multipart/form-data; boundary=XyZ\r\n"
        "Content-Length: 1000000\r\n\r\n"
    )
    part = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="pets.zip"\r\n'
        b"Content-Type: application/zip\r\n\r\n" + b"P" * 4096
    )
    with socket.create_connection((live_server.host, live_server.port)) as sock:
        sock.sendall(head.encode() + part)
        deadline = time.monotonic() + 30
        while not _staged_uploads(live_server.settings):  # the server is receiving the body
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.02)
    deadline = time.monotonic() + 30
    while not [r for r in caplog.records if "went away" in r.getMessage()]:
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.02)
    [gone] = [r for r in caplog.records if "went away" in r.getMessage()]
    assert gone.levelno == logging.INFO and gone.exc_info is None
    assert "POST /v1/datasets" in gone.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert _staged_uploads(live_server.settings) == []
    # The server goes on serving.
    assert httpx.get(f"{live_server.url}/healthz").status_code == 200


# ---------------------------------------------------------------------------- messages


@pytest.fixture
def ready(client: TestClient, settings: Settings) -> dict[str, str]:
    register_node(client, create_token(client, "worker"), "node-a", units=2)
    me = token_id(client, client.headers["Authorization"].split()[1])
    return {"train": insert_dataset(settings, me, name="t"), "val": insert_dataset(settings, me, name="v")}


@pytest.mark.parametrize(
    ("typed", "meant"), [("resnet81", "resnet18"), ("ResNet18", "resnet18"), ("densnet121", "densenet121")]
)
def test_architecture_typo_suggests_the_name(
    client: TestClient, ready: dict[str, str], typed: str, meant: str
) -> None:
    r = client.post("/v1/jobs", json=job_spec(ready["train"], ready["val"], model={"architecture": typed}))
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "InvalidModelDirectoryError"
    assert body["message"] == f"unknown architecture {typed!r}: did you mean {meant}?"
    assert body["details"] == {"field": "model.architecture", "value": typed, "suggestion": meant}


def test_unknown_architecture_without_a_close_name(client: TestClient, ready: dict[str, str]) -> None:
    r = client.post(
        "/v1/jobs", json=job_spec(ready["train"], ready["val"], model={"architecture": "qwertyuiop"})
    )
    assert r.status_code == 422
    assert "did you mean" not in r.json()["message"]
    assert "such as resnet18" in r.json()["message"]


@pytest.mark.parametrize("field", ["epochs", "batch_size", "patience", "print_frequency"])
def test_count_past_32_bits_names_the_whole_range(
    client: TestClient, ready: dict[str, str], field: str
) -> None:
    r = client.post("/v1/jobs", json=job_spec(ready["train"], ready["val"], parameters={field: 2**31}))
    assert r.status_code == 422
    [err] = r.json()["errors"]
    assert err["allowed"] == "> 0 and <= 2147483647"
    assert (
        f"parameters.{field}: Input should be less than or equal to 2147483647 (allowed: > 0 and <= 2147483647)"
        in (r.json()["message"])
    )


@pytest.mark.parametrize(
    ("body", "line", "column", "position"),
    [(b'{"name": "x",}', 1, 14, 13), (b'{\n  "name": "x"\n  "model": {}\n}', 3, 3, 18)],
)
def test_malformed_json_names_line_and_column(
    client: TestClient, body: bytes, line: int, column: int, position: int
) -> None:
    for url in ("/v1/jobs", "/v1/datasets"):
        r = _post_raw(client, url, body)
        assert r.status_code == 422, r.text
        message = r.json()["message"]
        assert f"malformed JSON at line {line}, column {column} (character {position}):" in message
        assert not re.search(rf"\b{position}: ", message)  # the position is not named as a field
    [err] = _post_raw(client, "/v1/jobs", body).json()["errors"]
    assert err["field"] == "body" and err["position"] == position and err["type"] == "json_invalid"


# ---------------------------------------------------------------------------- API docs


def _local_urls(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_everything_from_the_service(client: TestClient, page: str) -> None:
    r = client.get(page, headers={"Authorization": ""})
    assert r.status_code == 200
    html = r.text
    assert "://" not in html and "//cdn" not in html  # no other host
    urls = _local_urls(html)
    assert urls and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    for url in urls:
        asset = client.get(url, headers={"Authorization": ""})
        assert asset.status_code == 200, url
        assert len(asset.content) > 100, url
    if page == "/docs":
        assert "/docs/assets/swagger-ui-bundle.js" in urls and "/docs/assets/swagger-ui.css" in urls
        assert "<script>" not in html  # no inline script: the page's policy would block it
        init = client.get("/docs/swagger-init.js", headers={"Authorization": ""}).text
        assert '"validatorUrl": null' in init
        # A token typed into Authorize is not kept in the browser's localStorage.
        assert '"persistAuthorization": false' in init and 'persistAuthorization": true' not in init
    else:
        # ReDoc's script as served fetches no logo from its maker's CDN.
        script = client.get("/docs/assets/redoc.standalone.js", headers={"Authorization": ""})
        assert script.headers["content-type"].startswith("text/javascript")
        assert b"cdn.redoc.ly" not in script.content and b"redocly logo" in script.content
        again = client.get(
            "/docs/assets/redoc.standalone.js",
            headers={"Authorization": "", "If-None-Match": script.headers["etag"]},
        )
        assert again.status_code == 304


def test_openapi_declares_the_bearer_scheme(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    scheme = spec["components"]["securitySchemes"]["bearerAuth"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    unprotected = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            if operation.get("security") != [{"bearerAuth": []}]:
                unprotected.append(f"{method} {path}")
    # Health checks, the web UI's sign-in and sign-out (the token travels in the body, then in
    # the session cookie), the OpenID Connect sign-in's steps (docs/oidc.md), and the metrics
    # (a scrape token of their own, or allowed networks: docs/operations.md).
    assert sorted(unprotected) == [
        "delete /v1/session",
        "get /auth/oidc/config",
        "get /healthz",
        "get /metrics",
        "get /readyz",
        "post /auth/logout",
        "post /v1/session",
    ]
    # What the docs' Authorize button sends is what the service reads.
    token = client.headers["Authorization"].split()[1]
    assert client.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"}).json()["role"] == "admin"
