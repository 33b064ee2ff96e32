"""``GET /metrics`` scraped by a real Prometheus (Debian's binary, .ci/prometheus.sh): the API
serves, Prometheus scrapes it every second with the scrape token, a little work is done (a
node, two jobs: one placed, one waiting), and Prometheus's own HTTP API is asked for the
series. A second scrape job without the token shows the API refusing it."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from tests.conftest import LiveServer, free_port
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id
from tests.support.prometheus import Prometheus, require_prometheus

SCRAPE_TOKEN = "scrape-token-for-the-tests-0123"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, sqlite_template: Path) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("prometheus-api")
    shutil.copyfile(sqlite_template, folder / "torchyard.db")
    settings = Settings(
        data_dir=folder / "data",
        database_url=f"sqlite:///{folder / 'torchyard.db'}",
        metrics_token=SCRAPE_TOKEN,
    )
    server = LiveServer(settings).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(api: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = require_prometheus()
    target = f"127.0.0.1:{api.port}"
    server = Prometheus(
        binary,
        tmp_path_factory.mktemp("prometheus"),
        free_port(),
        [
            {
                "job_name": "torchyard",
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials": SCRAPE_TOKEN},
                "static_configs": [{"targets": [target]}],
            },
            {"job_name": "torchyard-no-token", "static_configs": [{"targets": [target]}]},
        ],
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def work(api: LiveServer) -> Iterator[dict[str, Any]]:
    """A node of 2 units and two jobs of 2 units each: the first placed, the second queued."""
    # The counters are the process's (one registry per process, as Prometheus scrapes it), and
    # this test process may have run other tests' servers before: counts are taken from here.
    before = _samples(httpx.get(f"{api.url}/metrics", headers=auth(SCRAPE_TOKEN)).text)
    with httpx.Client(base_url=api.url, headers=auth(api.admin_token), timeout=30) as client:
        register_node(client, create_token(client, "worker"), "metrics-node", units=2)
        me = token_id(client, api.admin_token)
        train = insert_dataset(api.settings, me, name="train")
        val = insert_dataset(api.settings, me, name="val")
        spec = job_spec(train, val, resources={"node_count": 1, "process_count_per_node": 2})
        first = client.post("/v1/jobs", json=spec | {"name": "placed"})
        second = client.post("/v1/jobs", json=spec | {"name": "waiting"})
        assert first.status_code == 201 and second.status_code == 201, (first.text, second.text)
        job_id = first.json()["id"]
        assert client.get(f"/v1/jobs/{job_id}").status_code == 200
        yield {"client": client, "job_id": job_id, "before": before}


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _base(work: dict[str, Any], name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` with ``labels`` before the module's work."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in work["before"].items() if n == name and wanted <= ls)


def _value(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def test_prometheus_scrapes_jobs_nodes_units_and_queue_wait(
    prometheus: Prometheus, work: dict[str, Any]
) -> None:
    assert _value(prometheus.wait_for('up{job="torchyard"} == 1')) == 1
    assert _value(prometheus.wait_for('torchyard_jobs{state="queued",team="default"} == 1')) == 1
    assert _value(prometheus.wait_for('torchyard_jobs{state="scheduled",team="default"} == 1')) == 1
    assert _value(prometheus.wait_for('torchyard_nodes{engine="agents",state="ready"} == 1')) == 1
    assert _value(prometheus.wait_for('torchyard_units{pool="default",state="used"} == 2')) == 2
    assert _value(prometheus.query('torchyard_units{pool="default",state="free"}')) == 0
    # The placed job's wait, observed once its placement committed.
    waits = _base(work, "torchyard_queue_wait_seconds_count")
    assert _value(prometheus.wait_for(f"torchyard_queue_wait_seconds_count >= {waits + 1}")) == waits + 1
    assert _value(prometheus.wait_for("torchyard_scheduling_pass_seconds_count > 0")) > 0
    assert _value(prometheus.wait_for("torchyard_upkeep_pass_seconds_count > 0")) > 0
    assert _value(prometheus.wait_for('torchyard_node_heartbeat_lag_seconds_bucket{le="+Inf"} == 1')) == 1
    assert _value(prometheus.query('torchyard_db_pool_size{pool="write"}')) > 0
    assert _value(prometheus.query("torchyard_database_up")) == 1
    directions = prometheus.query("torchyard_api_artifact_bytes_total")
    assert sorted(s["metric"]["direction"] for s in directions) == ["in", "out"]


def test_request_latency_is_labelled_by_route_template(prometheus: Prometheus, work: dict[str, Any]) -> None:
    submitted = prometheus.wait_for(
        'torchyard_http_request_duration_seconds_count{route="/v1/jobs",method="POST",status="201"}'
    )
    base = _base(
        work, "torchyard_http_request_duration_seconds_count", route="/v1/jobs", method="POST", status="201"
    )
    assert _value(submitted) == base + 2
    read = prometheus.wait_for('torchyard_http_request_duration_seconds_count{route="/v1/jobs/{job_id}"}')
    assert read[0]["metric"]["status"] == "200"
    # Never the raw path: no series names the job's id.
    job_id = work["job_id"]
    assert prometheus.query(f'{{__name__=~"torchyard_.*",route=~".*{job_id}.*"}}') == []
    # p95 by route, as the dashboard asks it.
    p95 = prometheus.wait_for(
        "histogram_quantile(0.95, sum by (le, route) "
        '(rate(torchyard_http_request_duration_seconds_bucket{route="/metrics"}[1m])))'
    )
    assert p95[0]["metric"]["route"] == "/metrics"


def test_a_scrape_without_the_token_is_refused(
    prometheus: Prometheus, api: LiveServer, work: dict[str, Any]
) -> None:
    assert _value(prometheus.wait_for('up{job="torchyard-no-token"} == 0')) == 0
    refused = [t for t in prometheus.targets() if t["labels"]["job"] == "torchyard-no-token"]
    assert "401" in refused[0]["lastError"]
    assert httpx.get(f"{api.url}/metrics").status_code == 401
    wrong = httpx.get(f"{api.url}/metrics", headers=auth("not-the-scrape-token"))
    assert wrong.status_code == 401
    assert wrong.json()["code"] == "AuthenticationError"
    right = httpx.get(f"{api.url}/metrics", headers=auth(SCRAPE_TOKEN))
    assert right.status_code == 200
    assert right.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE torchyard_jobs gauge" in right.text
    openmetrics = httpx.get(
        f"{api.url}/metrics",
        headers=auth(SCRAPE_TOKEN) | {"Accept": "application/openmetrics-text; version=1.0.0"},
    )
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")
    # A user's API token is not the scrape token.
    assert httpx.get(f"{api.url}/metrics", headers=auth(api.admin_token)).status_code == 401


def test_attempts_ended_are_counted_by_outcome(prometheus: Prometheus, work: dict[str, Any]) -> None:
    client: httpx.Client = work["client"]
    r = client.post(f"/v1/jobs/{work['job_id']}/cancel")
    assert r.status_code == 200, r.text
    base = _base(work, "torchyard_attempts_ended_total", outcome="cancelled")
    ended = prometheus.wait_for(f'torchyard_attempts_ended_total{{outcome="cancelled"}} >= {base + 1}')
    assert ended[0]["metric"]["failure_code"] == "none"
    assert _value(ended) == base + 1


def test_the_dashboard_and_the_docs_name_the_metrics_served(
    prometheus: Prometheus, api: LiveServer, work: dict[str, Any]
) -> None:
    text = httpx.get(f"{api.url}/metrics", headers=auth(SCRAPE_TOKEN)).text
    # (A gauge histogram's _gsum and _gcount come as gauges of their own in this format.)
    served = set(re.findall(r"^# TYPE (torchyard_\w+?)(?:_gsum|_gcount)? ", text, re.M))
    documented = set(
        re.findall(r"^\| `(torchyard_\w+)` \|", (ROOT / "docs" / "operations.md").read_text(), re.M)
    )
    assert documented == served
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "torchyard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"torchyard_\w+", e)}
    assert named <= served, named - served
    assert {"torchyard_jobs", "torchyard_queue_wait_seconds", "torchyard_units"} <= named
    for expr in exprs:  # each one valid PromQL: Prometheus answers it
        prometheus.query(expr)
