"""The web UI in a real Chromium (Debian's package, driven by Playwright) against a live
uvicorn server: sign-in, the new-job form's 422s, a real job's live chart, logs and
cancel, the jobs list's live status, dataset upload, one user not seeing another's job,
drain/undrain, a restarted job's attempts and per-attempt logs, registering a model
then predicting with it, and a sweep's live trials table and charts.

One database (SQLite) is enough here: the routes the UI calls run on both elsewhere.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from service.db.engine import Database
from service.db.types import utcnow
from service.services import team_usage
from tests.conftest import LiveServer, fast_leases
from tests.service.test_models_api import succeeded_job
from tests.support.attempt_history import restarted_job
from tests.support.factories import auth, create_token, insert_dataset, job_spec, register_node, token_id
from tests.support.report_helpers import make_script_job, point, post_report, start_running_job
from tests.support.script_helpers import code_archive
from tests.support.trained_model import Trained
from tests.support.worker_fixtures import (
    start_agent,
    upload_digits,
    wait_for_job,
    wait_for_node,
    worker_token,
)


@pytest.fixture
def settings(make_settings: Any) -> Settings:
    s: Settings = make_settings(
        # Nodes registered by hand never heartbeat: a long lease keeps them ready.
        **fast_leases(lease_s=600),
        max_nodes=1,
    )
    return s


@pytest.fixture
def admin(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, headers=auth(live_server.admin_token), timeout=60) as c:
        yield c


def _user(admin: httpx.Client, name: str) -> tuple[str, str]:
    token = create_token(admin, "user", name)
    return token, token_id(admin, token)


def _wait(predicate: Any, timeout: float = 30, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.1)


def _points(chart: Any) -> int:
    """The points a chart holds (its element's data-points)."""
    return int(chart.get_attribute("data-points") or 0)


def test_sign_in_keeps_the_token_out_of_reach_and_sign_out_ends_the_session(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    token, _ = _user(admin, "dora")
    ui = open_ui(live_server.url)
    page = ui.page
    page.goto("/")
    page.wait_for_selector("#signin-form")
    page.fill("#token", "ty_not-a-token")
    page.click("#signin-submit")
    page.wait_for_selector("#signin-error:has-text('invalid or revoked token')")

    ui.sign_in(token)
    assert page.text_content("#whoami") == "dora (user)"
    assert page.is_visible("#jobs-table")
    # The token lives in an HttpOnly cookie: page scripts cannot read it, and it is in no URL.
    assert token not in page.evaluate("document.cookie")
    assert token not in page.url
    cookie = next(c for c in ui.context.cookies() if c["name"] == "torchyard_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert ui.errors == []
    # A write without the CSRF header (as a form of another site would send) is refused.
    status = page.evaluate("fetch('/v1/jobs/x/cancel', {method: 'POST'}).then(r => r.status)")
    assert status == 403

    page.click("#sign-out")
    page.wait_for_selector("#signin-form")
    assert page.evaluate("fetch('/v1/whoami').then(r => r.status)") == 401
    assert not [c for c in ui.context.cookies() if c["name"] == "torchyard_session"]


def test_new_job_form_shows_each_422_next_to_its_field_then_submits(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    token, uid = _user(admin, "erin")
    register_node(admin, create_token(admin, "worker"), "cpu-1", units=2)
    train = insert_dataset(live_server.settings, uid, name="shapes-train")
    val = insert_dataset(live_server.settings, uid, name="shapes-val")
    ui = open_ui(live_server.url)
    ui.sign_in(token)
    page = ui.page
    page.click("#nav-new")
    page.wait_for_selector("#new-job-form")
    # Every parameter shows its range, readably: no machine epsilon, no "null".
    assert "16..1024" in page.text_content(".field[data-field='parameters.image_size']")
    lr_hint = page.text_content(".field[data-field='parameters.learning_rate'] .hint") or ""
    assert "allowed: > 0" in lr_hint and "e-16" not in lr_hint
    assert "2147483647" not in (page.text_content(".field[data-field='parameters.epochs'] .hint") or "")
    assert "empty for no limit" in (page.text_content(".field[data-field='resources.max_runtime_s']") or "")
    # Readable labels; the spec's field name in the label's title.
    lr_label = page.locator("label[for='f-parameters-learning_rate']")
    assert lr_label.text_content() == "Learning rate"
    assert lr_label.get_attribute("title") == "parameters.learning_rate"
    assert page.text_content("label[for='f-resources-process_count_per_node']") == "Processes per node"
    # It starts from what the README and the demo use on small images; the service's own
    # defaults (for photographs) are one choice away.
    fields = ("learning_rate", "image_size", "augmentation", "warmup_epochs", "batch_size")

    def values() -> list[str]:
        return [page.input_value(f"#f-parameters-{name}") for name in fields]

    assert values() == ["0.02", "32", "light", "1", "32"]
    page.select_option("#f-preset", "photos")
    assert values() == ["0.001", "224", "standard", "0", "16"]
    page.select_option("#f-preset", "small")
    assert values() == ["0.02", "32", "light", "1", "32"]
    ui.assert_clean_text()
    page.fill("#f-name", "shapes")
    assert "shapes-train (9 images, 3 classes)" in page.text_content("#f-train_dataset")
    page.select_option("#f-train_dataset", value=train)
    page.select_option("#f-validation_dataset", value=val)
    # The job's priority and the model's init_from_job have fields too.
    assert "-100..100" in page.text_content(".field[data-field='priority']")
    assert page.input_value("#f-model-init_from_job") == ""
    # The architecture is picked from the list of the ones a job may name.
    assert page.eval_on_selector("#f-model-architecture", "el => el.tagName") == "SELECT"
    assert page.input_value("#f-model-architecture") == "resnet18"
    assert page.locator("#f-model-architecture option[value='densenet121']").count() == 1
    # The learning rate the trainer will use: multiplied by the number of processes.
    page.fill("#f-parameters-learning_rate", "0.05")
    page.fill("#f-resources-process_count_per_node", "2")
    assert "0.05 × 2 processes = 0.1 effective" in page.text_content("#effective-lr-hint")
    page.fill("#f-resources-process_count_per_node", "1")
    assert "1 process: effective 0.05" in page.text_content("#effective-lr-hint")
    # ... reached after the warm-up (the preset's one epoch), as `torchyard show` says it.
    assert (
        "reached after a linear warm-up over the first epoch, then a linear decay to 0 at the end of epoch"
        in (page.text_content("#effective-lr-hint") or "")
    )
    page.fill("#f-parameters-epochs", "0")
    page.fill("#f-parameters-image_size", "8")
    page.fill("#f-priority", "101")
    page.click("#submit-job")
    epochs_error = page.locator("#err-f-parameters-epochs")
    epochs_error.wait_for()
    page.wait_for_selector("#err-f-parameters-epochs:not(:empty)")
    assert "greater than 0" in epochs_error.text_content()
    assert "16..1024" in page.text_content("#err-f-parameters-image_size")
    assert "less than or equal to 100" in page.text_content("#err-f-priority")
    assert "invalid" in page.get_attribute(".field[data-field='priority']", "class")
    assert page.text_content("#err-f-parameters-batch_size") == ""
    assert "invalid" in page.get_attribute(".field[data-field='parameters.epochs']", "class")

    # A limit of the cluster (a domain error, not a schema one) lands next to its field too.
    page.fill("#f-parameters-epochs", "2")
    page.fill("#f-parameters-image_size", "32")
    page.fill("#f-priority", "7")
    page.fill("#f-resources-node_count", "5")
    page.click("#submit-job")
    page.wait_for_selector("#err-f-resources-node_count:not(:empty)")
    assert "node_count 5 exceeds" in page.text_content("#err-f-resources-node_count")
    assert page.text_content("#err-f-parameters-epochs") == ""
    assert page.text_content("#err-f-priority") == ""

    page.fill("#f-resources-node_count", "1")
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f-]+$"))
    assert page.text_content("#job-name") == "shapes"
    job_id = page.url.rsplit("/", 1)[1]
    job = httpx.get(f"{live_server.url}/v1/jobs/{job_id}", headers=auth(token)).json()
    assert job["parameters"]["epochs"] == 2 and job["parameters"]["image_size"] == 32
    assert job["priority"] == 7 and job["model"]["init_from_job"] is None
    assert job["parameters"]["learning_rate"] == 0.05 and job["model"]["architecture"] == "resnet18"
    assert page.text_content("#effective-lr") == "0.05 (1 process: effective 0.05)"

    # The jobs list filters by status.
    page.click("#nav-jobs")
    page.wait_for_selector(f"tr[data-job-id='{job_id}']")
    page.select_option("#status-filter", "succeeded")
    page.wait_for_selector("#jobs-empty", state="visible")
    assert page.locator(f"tr[data-job-id='{job_id}']").count() == 0
    assert page.url.endswith("#/jobs?status=succeeded")
    # Placed on the node registered above, which never claims it: it stays scheduled.
    with httpx.Client(base_url=live_server.url, headers=auth(token), timeout=30) as user:
        wait_for_job(user, job_id, lambda j: j["status"] == "scheduled", timeout=30)
    page.select_option("#status-filter", "scheduled")
    row = page.locator(f"tr[data-job-id='{job_id}'][data-status='scheduled']")
    row.wait_for()
    # Its age shows; it has not started, so it has no duration yet.
    assert re.fullmatch(r"\d+s|\d+m \d+s", row.locator("td.age").text_content() or "")
    assert row.locator("td.duration").text_content() == ""
    # A job that the one free unit left cannot place waits in the queue; its page says why.
    waiting = job_spec(train, val, name="waits", resources={"node_count": 1, "process_count_per_node": 2})
    with httpx.Client(base_url=live_server.url, headers=auth(token), timeout=30) as user:
        r = user.post("/v1/jobs", json=waiting)
        assert r.status_code == 201, r.text
        reason = wait_for_job(user, r.json()["id"], lambda j: bool(j["reason"]), timeout=30)["reason"]
    assert "free units" in reason
    page.goto(f"/#/jobs/{r.json()['id']}")
    page.wait_for_selector("#job-status .badge[data-status='queued']")
    assert page.text_content("#reason") == reason

    # A script job from the same form: a code package and a command as typed.
    with httpx.Client(base_url=live_server.url, headers=auth(token), timeout=30) as user:
        code = user.post(
            "/v1/code",
            data={"name": "probe"},
            files={"file": ("src.tar.gz", code_archive({"train.py": "print(1)\n"}), "application/gzip")},
        )
        assert code.status_code == 201, code.text
    page.goto("/#/jobs/new?type=script")
    page.wait_for_selector("#new-job-form[data-type='script']")
    assert page.is_hidden("#train-fields") and page.is_visible("#script-fields")
    page.fill("#f-name", "my-script")
    page.fill("#f-command", "python train.py --note 'two words'")
    page.click("#submit-job")
    page.wait_for_selector("#err-f-code:not(:empty)")  # no code package chosen
    page.select_option("#f-code", value=code.json()["id"])
    page.select_option("#f-inputs-data", value=train)
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f-]+$"))
    script = httpx.get(f"{live_server.url}/v1/jobs/{page.url.rsplit('/', 1)[1]}", headers=auth(token)).json()
    assert script["type"] == "script" and script["name"] == "my-script"
    assert script["command"] == ["python", "train.py", "--note", "two words"]
    assert script["inputs"] == {"data": train}
    # An evaluation needs a registered model: the form says so.
    page.goto("/#/jobs/new?type=evaluate")
    page.wait_for_selector("#new-job-form[data-type='evaluate']")
    assert "no models" in (page.text_content("#f-model") or "")
    page.click("#submit-job")
    page.wait_for_selector("#err-f-model:not(:empty)")
    assert ui.errors == []


def test_a_user_never_sees_another_users_job(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    owner, owner_id = _user(admin, "frank")
    other, _ = _user(admin, "grace")
    register_node(admin, create_token(admin, "worker"), "cpu-1", units=1)
    train = insert_dataset(live_server.settings, owner_id)
    val = insert_dataset(live_server.settings, owner_id)
    r = httpx.post(
        f"{live_server.url}/v1/jobs", json=job_spec(train, val, name="franks-secret"), headers=auth(owner)
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    mine = open_ui(live_server.url)
    mine.sign_in(owner)
    mine.page.wait_for_selector(f"tr[data-job-id='{job_id}']")

    ui = open_ui(live_server.url)
    ui.sign_in(other)
    page = ui.page
    page.wait_for_selector("#jobs-empty", state="visible")
    assert page.locator(f"tr[data-job-id='{job_id}']").count() == 0
    assert "franks-secret" not in page.content()
    # Editing the URL does not help: the page gets the API's 404.
    page.goto(f"/#/jobs/{job_id}")
    page.wait_for_selector(".error")
    assert "NotFoundError" in page.text_content(".error")
    assert "franks-secret" not in page.content()
    assert page.evaluate(f"fetch('/v1/jobs/{job_id}/metrics/series').then(r => r.status)") == 404
    # Cancelling it through the cookie session (with the CSRF header) is a 404 as well.
    status = page.evaluate(
        f"fetch('/v1/jobs/{job_id}/cancel', {{method: 'POST', headers: {{'X-Torchyard-CSRF': '1'}}}})"
        ".then(r => r.status)"
    )
    assert status == 404
    still = httpx.get(f"{live_server.url}/v1/jobs/{job_id}", headers=auth(owner)).json()
    assert still["status"] in ("queued", "scheduled")  # placed on the node, not cancelled


def test_dataset_upload_shows_progress_and_class_counts(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any, tmp_path: Path
) -> None:
    import tarfile

    from torchyard.sample_data import write_digits

    token, _ = _user(admin, "hana")
    train_dir, _ = write_digits(tmp_path / "digits", per_class=4, size=16)
    archive = tmp_path / "digits.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(train_dir, arcname="digits")
    ui = open_ui(live_server.url)
    ui.sign_in(token)
    page = ui.page
    page.click("#nav-datasets")
    page.wait_for_selector("#upload-form")
    # The progress bar shows while the upload runs.
    page.evaluate(
        "new MutationObserver(() => { if (!document.querySelector('#upload-progress').hidden)"
        " window.progressShown = true; }).observe(document.querySelector('#upload-progress'),"
        " {attributes: true})"
    )
    page.fill("#upload-name", "digits-small")
    page.set_input_files("#upload-file", str(archive))
    page.click("#upload-submit")
    page.wait_for_selector("#upload-note:has-text('uploaded digits-small')")
    assert page.evaluate("window.progressShown === true")
    row = page.locator("tr.dataset-row", has_text="digits-small")
    assert row.count() == 1  # the note is written once the list is reloaded
    row.locator("summary").click()
    counts = row.locator(".class-counts tr")
    assert counts.count() == 10
    expected = len(list((train_dir / "0").iterdir()))
    assert counts.first.text_content().replace(" ", "") == f"0{expected}"
    assert ui.errors == []


def test_cluster_page_lists_nodes_and_units_and_admins_drain_and_undrain(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    register_node(admin, create_token(admin, "worker"), "cpu-7", units=3)
    ui = open_ui(live_server.url)
    ui.sign_in(live_server.admin_token)
    page = ui.page
    page.click("#nav-cluster")
    row = page.locator("tr.node-row[data-node='cpu-7']")
    row.wait_for()
    cells = row.locator("td").all_text_contents()
    assert cells[1] == "ready" and cells[3] == "3" and cells[4] == "3"
    assert "3 of 3 units free" in page.text_content("#cluster-summary")

    # A user sees the nodes but no drain controls.
    token, _ = _user(admin, "kai")
    other = open_ui(live_server.url)
    other.sign_in(token)
    other.page.click("#nav-cluster")
    other.page.locator("tr.node-row[data-node='cpu-7']").wait_for()
    assert other.page.locator("button.drain, button.undrain").count() == 0

    # The admin drains the node (nothing runs there: drained at once), then undrains it.
    row.locator("button.drain").click()
    page.wait_for_selector("tr.node-row[data-node='cpu-7'] .badge[data-status='drained']")
    nodes = {n["name"]: n for n in admin.get("/v1/cluster").json()["nodes"]}
    assert nodes["cpu-7"]["status"] == "drained"
    assert row.locator("button.drain").count() == 0
    row.locator("button.undrain").click()
    page.wait_for_selector("tr.node-row[data-node='cpu-7'] .badge[data-status='ready']")
    nodes = {n["name"]: n for n in admin.get("/v1/cluster").json()["nodes"]}
    assert nodes["cpu-7"]["status"] == "ready"
    assert row.locator("button.drain").count() == 1
    assert ui.errors == [] and other.errors == []


def test_teams_page_charts_usage_and_borrowing_and_the_queue_says_why_jobs_wait(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    for name in ("vision", "speech"):
        r = admin.post("/v1/teams", json={"name": name, "quotas": [{"nominal": 4, "borrowing_limit": 2}]})
        assert r.status_code == 201, r.text
    assert admin.post("/v1/users", json={"name": "ana", "teams": ["vision"]}).status_code == 201
    ana = admin.post("/v1/tokens", json={"name": "ana", "role": "user", "user": "ana"}).json()["token"]
    # 8 units: vision's job of 6 borrows 2 of speech's idle 4; its next job waits at its quota.
    register_node(admin, create_token(admin, "worker"), "cpu-t", units=8)
    owner = token_id(admin, ana)
    train = insert_dataset(live_server.settings, owner, name="t")
    val = insert_dataset(live_server.settings, owner, name="v")
    jobs = []
    for name, procs in (("big", 6), ("waits", 4)):
        spec = job_spec(train, val, name=name, resources={"node_count": 1, "process_count_per_node": procs})
        r = httpx.post(f"{live_server.url}/v1/jobs", json=spec, headers=auth(ana))
        assert r.status_code == 201, r.text
        jobs.append(r.json()["id"])
    waiting = jobs[1]
    _wait(
        lambda: any(q["id"] == waiting and q["reason"] for q in admin.get("/v1/queue").json()["items"]),
        what="the second job waiting with a reason",
    )
    # The sample the upkeep takes each minute, taken now (for a minute to come: newer than
    # any the server's own upkeep took).
    db = Database(live_server.settings.sqlalchemy_url)
    try:
        assert team_usage.sample(db, utcnow() + timedelta(minutes=1)) >= 2
    finally:
        db.dispose()

    ui = open_ui(live_server.url)
    ui.sign_in(live_server.admin_token)
    page = ui.page
    page.click("#nav-teams")
    page.wait_for_selector(".team-card[data-team='speech'] .team-chart[data-samples='1']")
    vision = page.locator(".team-card[data-team='vision']")
    assert vision.locator(".team-summary").text_content() == "using 6 of 4 · borrowing 2 · weight 1"
    assert "default: 4, may borrow 2, lends all idle" in (vision.locator(".team-quotas").text_content() or "")
    assert vision.locator(".team-members").text_content() == "Members: ana"
    assert page.locator(".borrow-line").all_text_contents() == ["vision borrows 2 from speech"]
    assert "lending 2" in (page.text_content(".team-card[data-team='speech'] .team-summary") or "")
    # The chart holds the sample: used and nominal, one point each.
    vision.locator(".team-chart[data-samples='1'][data-points='2']").wait_for()

    page.click("#nav-queue")
    row = page.locator(f"tr.queue-row[data-job='{waiting}']")
    row.wait_for()
    cells = row.locator("td").all_text_contents()
    assert cells[0] == "1" and cells[1].startswith("waits") and cells[2:6] == ["vision", "0", "4", "6/4 (+2)"]
    assert "team vision at its quota" in cells[6]
    assert page.locator("tr.queue-row").count() == 1
    ui.assert_clean_text()

    # A member sees their own team only.
    member = open_ui(live_server.url)
    member.sign_in(ana)
    member.page.click("#nav-teams")
    member.page.locator(".team-card[data-team='vision']").wait_for()
    assert member.page.locator(".team-card").count() == 1
    assert ui.errors == [] and member.errors == []


def test_a_restarted_job_shows_its_attempts_end_reasons_and_each_attempts_log(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    job = restarted_job(admin, live_server.settings)
    ui = open_ui(live_server.url)
    ui.sign_in(job.user_token)
    page = ui.page
    page.goto(f"/#/jobs/{job.job_id}")
    page.wait_for_selector("#attempts")
    assert page.text_content("#restarts") == "Restarts: 1 of 2"
    rows = page.locator("tr.attempt-row")
    assert rows.count() == 2
    first, second = (rows.nth(i).locator("td").all_text_contents() for i in range(2))
    assert first[0] == "1" and first[1] == "failed" and first[2] == f"{job.node} (1)"
    assert first[5] == "RankKilledError: rank 0 was killed by SIGKILL"
    assert second[0] == "2" and second[5] == "TrainingDivergedError: the loss is NaN"

    # The log shows the latest attempt; the attempt picker shows an earlier one's.
    page.wait_for_selector("#log-state:has-text('end of log')")
    assert page.text_content("#log") == "attempt two\n"
    assert page.is_visible("#log-attempt")
    page.select_option("#log-attempt", "1")
    page.wait_for_selector("#log[data-attempt='1']")
    page.wait_for_selector("#log-state:has-text('end of log')")
    assert page.text_content("#log") == "attempt one\n"
    page.select_option("#log-attempt", "")
    page.wait_for_selector("#log[data-attempt='']")
    page.wait_for_selector("#log-state:has-text('end of log')")
    assert page.text_content("#log") == "attempt two\n"

    # The chart has each epoch once: attempt 1's redone epochs are left out.
    page.wait_for_selector("#charts[data-ready='true']")
    assert page.get_attribute("#chart-loss", "data-points") == "14"
    # The log's font stack ends with emoji fonts, so MLflow's "🏃 View run" is drawn where
    # one is installed (and the page needs none).
    family = page.evaluate("getComputedStyle(document.querySelector('#log')).fontFamily")
    assert "monospace" in family and "Noto Color Emoji" in family and "Segoe UI Emoji" in family
    ui.assert_clean_text()
    assert ui.errors == []


def test_the_job_page_asks_for_its_series_at_once_and_for_logs_after_the_charts(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    job = restarted_job(admin, live_server.settings)
    ui = open_ui(live_server.url)
    ui.sign_in(job.user_token)
    page = ui.page
    page.goto(f"/#/jobs/{job.job_id}")
    page.reload()  # a fresh page: the session check and the schema are asked for again
    page.wait_for_selector("#charts[data-ready='true']")
    page.wait_for_selector("#log-state:has-text('end of log')")
    timing = page.evaluate(
        """() => ({
            ready: performance.getEntriesByName('torchyard:charts-ready')[0].startTime,
            requests: performance.getEntriesByType('resource')
                .filter((e) => e.initiatorType === 'fetch')
                .map((e) => [new URL(e.name).pathname, e.startTime]),
        })"""
    )
    started: dict[str, float] = {}
    for path, start in timing["requests"]:
        started.setdefault(path, start)
    base = f"/v1/jobs/{job.job_id}"
    # The schema is read beside the session check, the series beside the job.
    assert started["/openapi.json"] <= started["/v1/whoami"]
    assert started[f"{base}/metrics/series"] <= started[base]
    # Nothing else is fetched before the charts are drawn: the logs come after.
    logs = [start for path, start in timing["requests"] if path.startswith(f"{base}/logs")]
    assert logs and min(logs) >= timing["ready"]
    assert not any(path == f"{base}/metrics" for path, _ in timing["requests"])
    assert page.get_attribute("#chart-loss", "data-points") == "14"
    assert ui.errors == []


def test_register_a_succeeded_jobs_model_then_predict_on_the_models_page(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any, trained: Trained
) -> None:
    from service.db.engine import Database
    from service.db.models import Job

    token, uid = _user(admin, "lena")
    job_id = succeeded_job(live_server.settings, admin, trained, token)
    # The best epoch the job reported: its versions show this top-1.
    db = Database(live_server.settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            session.get_one(Job, job_id).best = {"attempt": 1, "epoch": 2, "val.loss": 0.1, "val.top1": 0.975}
    finally:
        db.dispose()
    ui = open_ui(live_server.url)
    ui.sign_in(token)
    page = ui.page
    page.goto(f"/#/jobs/{job_id}")
    # Download model is offered and its link answers with the model (the session cookie's).
    download = page.locator("#download-model")
    download.wait_for()
    assert download.is_visible()
    answer = page.request.get(download.get_attribute("href") or "")
    assert answer.status == 200 and len(answer.body()) > 0, answer.status
    page.click("#register")
    page.fill("#register-name", "digits")
    page.click("#register-form button[type='submit']")
    page.wait_for_selector("#register-result:has-text('registered digits version 1')")
    # A second registration is version 2.
    page.click("#register-form button[type='submit']")
    page.wait_for_selector("#register-result:has-text('registered digits version 2')")
    # The job's page says which versions came from it.
    assert page.text_content("#registered-models") == "digits version 1, digits version 2"
    page.reload()
    page.wait_for_selector("#registered-models a.registered-model >> nth=1")
    assert page.text_content("#registered-models") == "digits version 1, digits version 2"
    page.click("#registered-models a >> nth=0")
    page.wait_for_selector("#version-2")
    assert page.text_content("#model-name") == "Model digits"
    assert page.locator("section.model-version").count() == 2
    # Nothing but the versions under the heading (no "null" for the note it has not).
    assert page.locator("#model-note").count() == 0
    ui.assert_clean_text()
    assert "(latest)" in page.text_content("#version-2 h2")
    assert "resnet18 · 32 px · 10 classes" in page.text_content("#version-1")

    # Choosing images predicts their labels with the version's model.
    page.set_input_files("#predict-file-1", [str(p) for p in trained.held_out[:2]])
    page.wait_for_selector("#predictions-1 .prediction >> nth=1")
    predictions = page.locator("#predictions-1 .prediction")
    classes = {str(d) for d in range(10)}
    for i, path in enumerate(trained.held_out[:2]):
        text = predictions.nth(i).text_content() or ""
        assert text.startswith(path.name)
        assert predictions.nth(i).get_attribute("data-label") in classes
        assert "%" in text
    # Dropping an image on a version predicts it as well.
    data = trained.held_out[0].read_bytes()
    page.evaluate(
        """([bytes, name]) => {
            const dt = new DataTransfer();
            dt.items.add(new File([new Uint8Array(bytes)], name, {type: "image/png"}));
            document.querySelector("#dropzone-2").dispatchEvent(
                new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true}));
        }""",
        [list(data), "dropped.png"],
    )
    page.wait_for_selector("#predictions-2 .prediction:has-text('dropped.png')")
    assert page.get_attribute("#predictions-2 .prediction", "data-label") in classes

    # Each version shows its job's top-1 and offers its model directory and ONNX export.
    assert page.text_content("#top1-1") == "top-1 97.5%"
    for link in ("#download-dir-1", "#download-onnx-1"):
        answer = page.request.get(page.get_attribute(link, "href") or "")
        assert answer.status == 200 and len(answer.body()) > 1000, (link, answer.status)
    assert page.get_attribute("#download-dir-1", "href") == f"/v1/jobs/{job_id}/model"

    # The new-job form evaluates a registered version on a dataset.
    register_node(admin, create_token(admin, "worker"), "cpu-eval", units=1)
    digits_val = insert_dataset(
        live_server.settings, uid, name="digits-val", classes=[str(d) for d in range(10)]
    )
    page.goto("/#/jobs/new?type=evaluate")
    page.wait_for_selector("#new-job-form[data-type='evaluate']")
    assert "digits version 2 (top-1 97.5%)" in (page.text_content("#f-model") or "")
    page.select_option("#f-model", value="digits:1")
    page.select_option("#f-dataset", value=digits_val)
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"#/jobs/[0-9a-f-]+$"))
    page.wait_for_selector("#evaluation")
    assert page.text_content("#evaluated-model") == "digits version 1"
    evaluation = httpx.get(
        f"{live_server.url}/v1/jobs/{page.url.rsplit('/', 1)[1]}", headers=auth(token)
    ).json()
    assert evaluation["type"] == "evaluate" and evaluation["model"] == "digits:1"
    httpx.post(f"{live_server.url}/v1/jobs/{evaluation['id']}/cancel", headers=auth(token))

    # A version is deleted from its page; the other stays.
    page.goto("/#/models/digits")
    page.wait_for_selector("#version-2")
    page.click("#delete-version-2")  # the confirmation is accepted (UiPage says yes)
    page.wait_for_selector("#model-note:has-text('Deleted version 2.')")
    assert page.locator("section.model-version").count() == 1
    assert httpx.get(f"{live_server.url}/v1/models/digits/versions/2", headers=auth(token)).status_code == 404

    # The models list shows it with its latest version and top-1.
    page.click("#nav-models")
    row = page.locator("tr.model-row[data-model='digits']")
    row.wait_for()
    assert row.locator("td").all_text_contents()[1:4] == ["1", "resnet18", "97.5%"]
    assert ui.errors == []


@pytest.mark.slow
def test_a_running_job_live_status_chart_log_and_cancel(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any, tmp_path: Path
) -> None:
    token, _ = _user(admin, "ivan")
    # The agent starts first: its start-up overlaps the dataset uploads.
    agent = start_agent(live_server.url, worker_token(admin), "cpu-1", tmp_path / "agent", slots=1)
    with httpx.Client(base_url=live_server.url, headers=auth(token), timeout=60) as user:
        try:
            train, val = upload_digits(user, tmp_path / "digits", per_class=10, size=16)
            wait_for_node(user, "cpu-1")
            jobs_tab = open_ui(live_server.url)
            jobs_tab.sign_in(token)
            jobs_tab.page.wait_for_selector("#jobs-live:has-text('live')")

            spec = job_spec(
                train,
                val,
                name="live-digits",
                parameters={
                    "epochs": 200,
                    "batch_size": 8,
                    "image_size": 16,
                    "augmentation": "none",
                    "print_frequency": 1,
                    "patience": 200,
                },
            )
            r = user.post("/v1/jobs", json=spec)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            # The jobs list learns of the job and of its start from the stream, without a reload.
            row = jobs_tab.page.locator(f"tr[data-job-id='{job_id}']")
            row.wait_for()
            jobs_tab.page.wait_for_selector(
                f"tr[data-job-id='{job_id}'][data-status='running']", timeout=90_000
            )

            ui = open_ui(live_server.url)
            ui.sign_in(token)
            page = ui.page
            page.goto(f"/#/jobs/{job_id}")
            page.wait_for_selector("#charts[data-ready='true']")
            loss = page.locator("#chart-loss")

            def loss_points() -> int:
                return int(loss.get_attribute("data-points") or 0)

            first = _wait(loss_points, 60, "a first loss point")
            _wait(lambda: loss_points() > first, 60, "more loss points")
            # The validation metrics (each epoch), learning rate and throughput charts grow too.
            for chart in ("accuracy", "lr", "throughput"):
                box = page.locator(f"#chart-{chart}")
                seen = _wait(lambda box=box: _points(box), 60, f"a first {chart} point")
                _wait(lambda box=box, seen=seen: _points(box) > seen, 60, f"more {chart} points")
            assert page.evaluate("performance.getEntriesByType('navigation').length") == 1  # no reload
            # Progress with the time left.
            page.wait_for_selector("#progress:has-text('left')", timeout=30_000)
            assert re.search(
                r"epoch \d+/200, step \d+/\d+ \(\d+%\), about \d+\S* .*left",
                page.text_content("#progress") or "",
            )
            # The jobs list shows how long it has been running, and a progress bar with the time left.
            assert re.fullmatch(r"\d+s|\d+m \d+s", row.locator("td.duration").text_content() or "")
            row.locator("td.progress progress").wait_for(timeout=30_000)
            jobs_tab.page.wait_for_selector(
                f"tr[data-job-id='{job_id}'] td.progress:has-text('left')", timeout=30_000
            )
            assert re.fullmatch(r"\d+% \S+.* left", row.locator("td.progress").text_content() or "")
            # Each rank's system metrics get their own group of charts (sampled every 5 s).
            page.wait_for_selector("#system-charts #chart-sys-cpu", timeout=60_000)
            assert page.is_visible("#system-head")
            for chart in ("sys-rss", "sys-input-wait"):
                page.wait_for_selector(f"#system-charts #chart-{chart}", timeout=10_000)

            # The rank-0 log follows.
            page.wait_for_selector("#log-stream option[value='rank-0']", state="attached")
            _wait(lambda: len(page.text_content("#log") or "") > 0, 60, "log text")
            before = len(page.text_content("#log") or "")
            _wait(lambda: len(page.text_content("#log") or "") > before, 60, "more log text")

            page.click("#cancel")
            page.wait_for_selector("#job-status .badge[data-status='cancelled']", timeout=60_000)
            assert not page.is_visible("#cancel")
            jobs_tab.page.wait_for_selector(f"tr[data-job-id='{job_id}'][data-status='cancelled']")
            assert wait_for_job(user, job_id)["status"] == "cancelled"
            assert ui.errors == [] and jobs_tab.errors == []
        finally:
            agent.discard()


def test_a_failed_job_shows_its_failure_rank_node_and_traceback(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    from service.db.engine import Database
    from service.db.models import Job
    from service.db.types import utcnow

    token, uid = _user(admin, "jana")
    register_node(admin, create_token(admin, "worker"), "cpu-1", units=1)
    train = insert_dataset(live_server.settings, uid)
    r = httpx.post(
        f"{live_server.url}/v1/jobs", json=job_spec(train, train, name="diverges"), headers=auth(token)
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    # The failure as the trainer's report leaves it (a real divergence takes minutes to provoke).
    db = Database(live_server.settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            job = session.get_one(Job, job_id)
            job.status, job.finished_at, job.updated_at = "failed", utcnow(), utcnow()
            job.failure_code = "TrainingDivergedError"
            job.failure_message = "train.loss became nan at epoch 2: try a lower learning_rate"
            job.failure_rank, job.failure_node = 1, "cpu-1"
            job.failure_traceback = (
                'Traceback (most recent call last):\n  File "engine.py", line 3\n<b>not markup</b>'
            )
    finally:
        db.dispose()

    ui = open_ui(live_server.url)
    ui.sign_in(token)
    page = ui.page
    page.goto(f"/#/jobs/{job_id}")
    page.wait_for_selector("#failure")
    assert "TrainingDivergedError" in page.text_content("#failure h2")
    assert "try a lower learning_rate" in page.text_content("#failure-message")
    assert "rank 1 on node cpu-1" in page.text_content("#failure")
    # Text from a worker is shown as text, never as markup.
    assert "<b>not markup</b>" in page.text_content("#traceback")
    assert page.locator("#traceback b").count() == 0
    assert not page.is_visible("#cancel") and not page.is_visible("#download-model")
    assert ui.errors == []


def test_select_jobs_in_the_list_and_compare_them(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    token, _ = _user(admin, "quinn")
    jobs = []
    # cmp-c has twice the batch size: half the steps per epoch.
    for name, lr, batch, top1 in (
        ("cmp-a", 0.1, 16, [0.4, 0.8]),
        ("cmp-b", 0.017439263563117445, 16, [0.3, 0.5]),
        ("cmp-c", 0.1, 32, [0.6, 0.6]),
    ):
        job = start_running_job(
            live_server.settings,
            admin,
            per_node=1,
            user_token=token,
            name=name,
            parameters={"learning_rate": lr, "batch_size": batch},
        )
        steps = 160 // batch
        points = [point("val.top1", v, epoch=e, step=e * steps) for e, v in enumerate(top1, start=1)]
        # The rest of what the trainer reports: seven metrics, fourteen results columns.
        for metric, value in (
            ("train.loss", 2.0),
            ("train.lr", lr),
            ("train.images_per_sec", 150.0),
            ("val.loss", 1.5),
            ("val.top5", 0.9),
            ("epoch.seconds", 31.5),
        ):
            points += [point(metric, value / e, epoch=e, step=e * steps) for e in (1, 2)]
        assert post_report(admin, job, metrics=points).status_code == 200
        jobs.append(job)
    # A script job that logs with MLflow: val.top1 at steps (no epochs), params and tags.
    running = start_running_job(live_server.settings, admin, per_node=1, user_token=token, name="cmp-script")
    make_script_job(live_server.settings, admin, running, ["python", "train.py", "--epochs", "3"])
    run = {"id": "a" * 32, "name": "train", "experiment": "Default", "status": "RUNNING", "rank": 0,
           "params": {"lr": "0.1", "optimizer": "adam"}, "tags": {"team": "vision", "mlflow.user": "quinn"}}  # fmt: skip
    by_step = [point("val.top1", v, epoch=0, step=s) for s, v in ((100, 0.5), (200, 0.7), (300, 0.65))]
    assert post_report(admin, running, metrics=by_step, tracking={"runs": [run]}).status_code == 200
    script = running.job_id
    ui = open_ui(live_server.url)
    ui.sign_in(token)
    page = ui.page
    page.wait_for_selector("#jobs-table tr.job-row")
    assert page.is_disabled("#compare-selected")
    for job in jobs[:2]:
        page.check(f"tr[data-job-id='{job.job_id}'] input.select-job")
    assert page.text_content("#compare-selected") == "Compare 2"
    page.click("#compare-selected")
    page.wait_for_selector("#compare-results")
    # A deep link: the URL names the jobs.
    assert f"ids={jobs[0].job_id},{jobs[1].job_id}" in page.url
    # One chart per metric, a line per job named by the job alone; what differs shows on
    # hovering its legend entry.
    page.wait_for_selector(
        "#compare-charts[data-ready='true'] .chart-box[data-metric='val.top1'][data-points='4']"
    )
    assert page.locator("#compare-charts .chart-box").count() == 7
    legend = page.locator(".chart-box[data-metric='val.top1'] .u-legend")
    assert "learning_rate" not in (legend.text_content() or "")
    entry = legend.locator(".u-series").nth(1)
    assert (entry.text_content() or "").startswith("cmp-a")
    assert "learning_rate = 0.1" in (entry.get_attribute("title") or "")
    assert "learning_rate = 0.01744" in (legend.locator(".u-series").nth(2).get_attribute("title") or "")
    # The differing parameter first, marked, its value to 4 significant digits (all of it on hover).
    first = page.locator("#compare-params tbody tr").first
    assert first.get_attribute("data-key") == "parameters.learning_rate"
    assert first.get_attribute("class") == "differs"
    assert first.locator("td").all_text_contents() == ["parameters.learning_rate", "0.1", "0.01744"]
    assert first.locator("td").nth(2).get_attribute("title") == "0.017439263563117445"
    # The results table: best with its epoch, sortable.
    rows = page.locator("#compare-results tbody tr")
    assert [rows.nth(i).get_attribute("data-job-id") for i in range(2)] == [j.job_id for j in jobs[:2]]
    assert "80.0% (epoch 2)" in (rows.nth(0).text_content() or "")  # accuracies in %
    best_top1 = page.locator("#compare-results th", has_text="val.top1 best (max)")
    best_top1.click()  # ascending: cmp-b (0.5) first
    assert rows.nth(0).get_attribute("data-job-id") == jobs[1].job_id
    best_top1.click()  # descending: cmp-a (0.8) first
    assert rows.nth(0).get_attribute("data-job-id") == jobs[0].job_id

    # Opened directly with a metric chosen: that metric alone, on the epoch axis, where cmp-c's
    # 10 steps and cmp-a's 20 are both epoch 2; the step axis on asking.
    page.goto(f"/#/compare?ids={jobs[0].job_id},{jobs[2].job_id}&metrics=val.top1")
    page.wait_for_selector(
        "#compare-charts[data-ready='true'][data-axis='epoch'] .chart-box[data-points='4']"
    )
    assert page.locator("#compare-charts .chart-box").count() == 1
    box = page.locator(".chart-box[data-metric='val.top1']")
    assert box.locator(".u-legend .u-series").first.text_content() == "epoch2"
    assert max(float(t) for t in (box.get_attribute("data-x-ticks") or "").split()) <= 2
    page.select_option("#compare-x", "step")
    page.wait_for_selector("#compare-charts[data-ready='true'][data-axis='step'] .chart-box[data-points='4']")
    assert box.locator(".u-legend .u-series").first.text_content() != "epoch2"
    assert (
        page.locator(".chart-box[data-metric='val.top1'] .u-legend .u-series").first.text_content()
        == "step20"
    )
    assert page.url.endswith("&x=step")

    # A training job beside a script job in a 1400 px window: the page stays 1400 px wide (the
    # wide tables scroll in their boxes), the script (no epochs) is named beside the axis
    # switch, and parallel coordinates draw a line per job.
    page.set_viewport_size({"width": 1400, "height": 900})
    ids = ",".join([*(j.job_id for j in jobs), script])
    page.goto(f"/#/compare?ids={ids}&x=epoch")
    page.wait_for_selector("#compare-charts[data-ready='true'][data-axis='epoch']")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1400
    assert "cmp-script" in (page.text_content("#compare-x-note") or "")
    assert page.locator("#compare-parallel-chart path.pc-line").count() == 4
    assert int(page.get_attribute("#compare-parallel-chart", "data-axes") or 0) >= 3
    # What the script's MLflow run logged: rows beside the spec's parameters (not MLflow's
    # own mlflow.* tags), and its best value where it was: a step.
    logged = page.locator("#compare-params tr[data-logged='true']")
    assert [logged.nth(i).get_attribute("data-key") for i in range(logged.count())] == [
        "mlflow: lr",
        "mlflow: optimizer",
        "mlflow tag: team",
    ]
    assert logged.first.get_attribute("class") == "differs"
    assert logged.first.locator("td").all_text_contents() == ["mlflow: lr", "–", "–", "–", "0.1"]
    assert "mlflow.user" not in (page.text_content("#compare-params") or "")
    script_row = page.locator(f"#compare-results tr[data-job-id='{script}']")
    assert "70.0% (step 200)" in (script_row.text_content() or "")
    assert "(epoch 0)" not in (page.text_content("#compare-results") or "")
    ui.assert_clean_text()

    # The script's page: a card of its MLflow run's params and tags.
    page.goto(f"/#/jobs/{script}")
    page.wait_for_selector("#tracking .mlflow-run[data-run-name='train']")
    rows = page.locator("#tracking tr.tracking-row")
    assert [rows.nth(i).locator("td").all_text_contents() for i in range(rows.count())] == [
        ["param", "lr", "0.1"],
        ["param", "optimizer", "adam"],
        ["tag", "team", "vision"],
    ]
    assert "experiment Default" in (page.text_content("#tracking h3") or "")
    ui.assert_clean_text()
    assert ui.errors == []


# The figures an evaluation of a 3-class model on 9 images reports (worker/trainer/evaluate.py).
_EVALUATION = {
    "num_images": 9,
    "loss": 0.6931,
    "top1": 6 / 9,
    "top5": 1.0,
    "classes": ["a", "b", "c"],
    "per_class": [
        {"label": "a", "precision": 0.75, "recall": 1.0, "f1": 6 / 7, "support": 3},
        {"label": "b", "precision": 0.5, "recall": 1 / 3, "f1": 0.4, "support": 3},
        {"label": "c", "precision": 2 / 3, "recall": 2 / 3, "f1": 2 / 3, "support": 3},
    ],
    "confusion_matrix": [[3, 0, 0], [1, 1, 1], [0, 1, 2]],
}


def _succeeded_evaluation(settings: Settings, owner: str, dataset: str) -> str:
    """An evaluation job as its worker's report leaves it: succeeded after one attempt, its
    result and best (epoch 0) stored as the report route stores them."""
    from service.db.engine import Database
    from service.db.models import Attempt, Job
    from service.db.types import utcnow

    best = {"val.loss": _EVALUATION["loss"], "val.top1": _EVALUATION["top1"], "val.top5": 1.0}
    result = {
        "attempt": 1,
        "best_epoch": 0,
        "best": best,
        "final": None,
        "stopped_early": False,
        "epochs_run": 0,
        "evaluation": _EVALUATION,
    }
    spec = {
        "type": "evaluate",
        "name": "evaluate-shapes-1",
        "model": "shapes:1",
        "dataset": dataset,
        "batch_size": 64,
        "priority": 0,
        "resources": {"node_count": 1, "process_count_per_node": 1},
    }
    db = Database(settings.sqlalchemy_url)
    now = utcnow()
    try:
        with db.transaction() as session:
            job = Job(
                owner_id=owner,
                type="evaluate",
                name=spec["name"],
                status="succeeded",
                spec=spec,
                architecture="resnet18",
                validation_dataset_id=dataset,
                node_count=1,
                process_count_per_node=1,
                attempts_count=1,
                best={"attempt": 1, "epoch": 0, **best},
                result=result,
                created_at=now,
                updated_at=now,
                started_at=now,
                finished_at=now,
            )
            session.add(job)
            session.flush()
            session.add(
                Attempt(
                    job_id=job.id,
                    number=1,
                    status="succeeded",
                    master_addr="127.0.0.1",
                    master_port=29500,
                    started_at=now,
                    finished_at=now,
                )
            )
            return job.id
    finally:
        db.dispose()


def _steps_only(settings: Settings, job_id: str, name: str, values: list[float]) -> None:
    """A script job that reported ``name`` at steps 0, 1, 2… and no epoch in its first attempt
    (the one its placement made, else a new one), then succeeded."""
    from sqlalchemy import select

    from service.db.engine import Database
    from service.db.models import Attempt, Job, Metric
    from service.db.types import utcnow

    db = Database(settings.sqlalchemy_url)
    now = utcnow()
    try:
        with db.transaction() as session:
            job = session.get_one(Job, job_id)
            job.status, job.started_at, job.finished_at, job.attempts_count = "succeeded", now, now, 1
            attempt = session.scalars(select(Attempt).where(Attempt.job_id == job_id)).first()
            if attempt is None:
                attempt = Attempt(job_id=job_id, number=1, master_addr="127.0.0.1", master_port=29500)
                session.add(attempt)
            attempt.status, attempt.started_at, attempt.finished_at = "succeeded", now, now
            session.flush()
            for step, value in enumerate(values):
                session.add(
                    Metric(
                        job_id=job_id,
                        attempt_id=attempt.id,
                        name=name,
                        value=value,
                        epoch=0,
                        step=step,
                        rank=0,
                        time=now,
                    )
                )
    finally:
        db.dispose()


def test_each_job_type_shows_what_it_has_in_the_list_and_on_its_page(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    token, uid = _user(admin, "olga")
    register_node(admin, create_token(admin, "worker"), "cpu-1", units=1)
    dataset = insert_dataset(live_server.settings, uid, name="shapes-val")
    evaluation = _succeeded_evaluation(live_server.settings, uid, dataset)
    # A training job on 2 processes that reported two epochs.
    train = start_running_job(
        live_server.settings,
        admin,
        per_node=2,
        user_token=token,
        name="trains",
        parameters={"learning_rate": 0.05},
    )
    points = [point("train.loss", 2.0 / e, epoch=e, step=e * 10) for e in (1, 2)]
    for e, (loss, top1) in enumerate(((0.9, 0.6), (0.3, 0.9)), start=1):
        points += [
            point("val.loss", loss, epoch=e, step=e * 10),
            point("val.top1", top1, epoch=e, step=e * 10),
        ]
    assert post_report(admin, train, metrics=points).status_code == 200
    # A script job (queued on the hand-registered node, which never claims it).
    with httpx.Client(base_url=live_server.url, headers=auth(token), timeout=30) as user:
        code = user.post(
            "/v1/code",
            data={"name": "probe"},
            files={"file": ("src.tar.gz", code_archive({"train.py": "print(1)\n"}), "application/gzip")},
        )
        assert code.status_code == 201, code.text
        r = user.post(
            "/v1/jobs",
            json={
                "type": "script",
                "name": "my-script",
                "code": code.json()["id"],
                "command": ["python", "train.py", "--epochs", "3"],
            },
        )
        assert r.status_code == 201, r.text
        script = r.json()["id"]

    ui = open_ui(live_server.url)
    ui.sign_in(token)
    page = ui.page
    # The list: each job's type, a detail fitting it and the best top-1 in %.
    for job_id in (evaluation, train.job_id, script):
        page.wait_for_selector(f"tr[data-job-id='{job_id}']")

    def cells(job_id: str) -> dict[str, str]:
        row = page.locator(f"tr[data-job-id='{job_id}']")
        return {name: row.locator(f"td.{name}").text_content() or "" for name in ("type", "reason", "best")}

    assert cells(evaluation) == {
        "type": "evaluation",
        "reason": "model shapes:1: top-1 66.7%",
        "best": "66.7%",
    }
    assert cells(train.job_id) == {"type": "train", "reason": "", "best": "90.0%"}
    assert cells(script) == {"type": "script", "reason": "$ python train.py --epochs 3", "best": ""}

    # The evaluation's page: its results, no training charts, no restart budget, no epoch.
    page.goto(f"/#/jobs/{evaluation}")
    page.wait_for_selector("#evaluation #eval-summary")
    assert page.text_content("#eval-summary") == "top-1 66.67%, top-5 100.00%, loss 0.6931 on 9 images"
    rows = page.locator("#eval-per-class tbody tr")
    assert rows.count() == 3
    assert rows.nth(1).locator("td").all_text_contents() == ["b", "50.0%", "33.3%", "40.0%", "3"]
    matrix = page.locator("#confusion-matrix tbody tr")
    counts = [[c.get_attribute("data-count") for c in matrix.nth(i).locator("td").all()] for i in range(3)]
    assert counts == [["3", "0", "0"], ["1", "1", "1"], ["0", "1", "2"]]
    # Shaded by the share of the row: the 3 of 3 right answers darker than 1 of 3.
    shade = "(i) => getComputedStyle(document.querySelectorAll('#confusion-matrix td.diagonal')[i]).backgroundColor"
    assert page.evaluate(shade, 0) != page.evaluate(shade, 1)
    assert page.text_content("#evaluated-model") == "shapes version 1"
    page.wait_for_selector("dd:has-text('shapes-val (9 images)')")
    assert page.locator("#charts, #restarts, #best, #effective-lr").count() == 0
    summary = page.text_content("#job-status") or ""
    assert "of ?" not in summary and "epoch 0" not in summary
    assert page.locator("tr.attempt-row").count() == 1
    spec = page.text_content("#spec pre") or ""
    assert '"dataset": "' + dataset + '"' in spec and '"batch_size": 64' in spec
    # No note, no failure: nothing reads null (the tags card had it).
    ui.assert_clean_text()

    # A training job's page: the effective learning rate, the best values in %, the loss on a
    # logarithmic axis and the accuracy in %.
    page.goto(f"/#/jobs/{train.job_id}")
    page.wait_for_selector("#charts[data-ready='true']")
    assert page.text_content("#effective-lr") == "0.05 × 2 processes = 0.1 effective"
    assert page.text_content("#best") == "val.top1 90.00%, val.loss 0.3 (epoch 2)"
    assert page.get_attribute("#chart-loss", "data-scale") == "log"
    assert page.get_attribute("#chart-accuracy", "data-unit") == "percent"
    assert "90%" in (page.text_content("#chart-accuracy .u-legend") or "")
    ui.assert_clean_text()

    # A script job's page: no trainer charts before it reports a metric, no learning rate.
    page.goto(f"/#/jobs/{script}")
    page.wait_for_selector("#charts[data-ready='true']")
    assert page.locator("#charts .chart-box").count() == 0
    assert page.is_visible("#charts .no-metrics")
    assert "python train.py --epochs 3" in (page.text_content("#summary") or "")
    assert page.locator("#effective-lr, #evaluation").count() == 0
    ui.assert_clean_text()
    # Its metric at steps 0, 1 and 2: whole steps on the x axis, never 0.5 or 1.5.
    _steps_only(live_server.settings, script, "loss", [0.9, 0.5, 0.4])
    page.reload()
    page.wait_for_selector("#charts[data-ready='true'] #chart-loss[data-x-ticks]")
    ticks = [float(t) for t in (page.get_attribute("#chart-loss", "data-x-ticks") or "").split()]
    assert ticks and all(t.is_integer() for t in ticks), ticks
    ui.assert_clean_text()
    assert ui.errors == []


def test_the_api_docs_pages_fetch_nothing_from_another_host(live_server: LiveServer, open_ui: Any) -> None:
    ui = open_ui(live_server.url)
    page = ui.page
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto("/redoc")
    # ReDoc has drawn the schema's operations (and its menu, where its logo would be).
    page.wait_for_selector("[data-section-id*='operation/']", state="attached")
    page.goto("/docs")
    page.wait_for_selector(".swagger-ui .opblock")
    # This service's own URLs, its blobs (ReDoc's search worker) and inline data: nothing else.
    own = (live_server.url, f"blob:{live_server.url}", "data:")
    elsewhere = [url for url in requested if not url.startswith(own)]
    assert requested and elsewhere == []


def test_a_jobs_tags_note_clone_and_delete_on_its_page(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    from service.db.engine import Database
    from service.db.models import Job
    from service.db.types import utcnow

    token, uid = _user(admin, "kira")
    register_node(admin, create_token(admin, "worker"), "cpu-1", units=1)
    train = insert_dataset(live_server.settings, uid)
    user = httpx.Client(base_url=live_server.url, headers=auth(token), timeout=60)
    r = user.post("/v1/jobs", json=job_spec(train, train, name="lr-sweep", parameters={"epochs": 3}))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    db = Database(live_server.settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            job = session.get_one(Job, job_id)
            job.status, job.finished_at, job.updated_at = "cancelled", utcnow(), utcnow()
    finally:
        db.dispose()

    ui = open_ui(live_server.url)
    ui.sign_in(token)
    page = ui.page
    page.goto(f"/#/jobs/{job_id}")
    page.wait_for_selector("#labels")
    assert "no tags" in page.text_content("#job-tags")
    # No note: nothing under the tags (never the word null).
    assert page.locator("#job-note").count() == 0
    assert "null" not in (page.text_content("#labels") or "")
    ui.assert_clean_text()
    page.click("#edit-labels")
    page.fill("#tags-input", "baseline, lr-0.05")
    page.fill("#note-input", "first try: <b>kept as text</b>")
    page.click("#save-labels")
    page.wait_for_selector("#job-tags .tag")
    assert [t.text_content() for t in page.locator("#job-tags .tag").all()] == ["baseline", "lr-0.05"]
    assert page.text_content("#job-note") == "first try: <b>kept as text</b>"
    stored = user.get(f"/v1/jobs/{job_id}").json()
    assert stored["tags"] == ["baseline", "lr-0.05"] and stored["note"].startswith("first try")

    # Clone: the same spec as a new job, whose page opens.
    page.click("#clone")
    hash_now = lambda: page.evaluate("location.hash")  # noqa: E731
    url = _wait(lambda: job_id not in hash_now() and hash_now(), what="the clone's page")
    clone_id = url.rsplit("/", 1)[-1]
    clone = user.get(f"/v1/jobs/{clone_id}").json()
    assert clone["name"] == "lr-sweep" and clone["parameters"]["epochs"] == 3
    page.wait_for_selector("#job-name:has-text('lr-sweep')")
    # A queued job cannot be deleted yet: it has no Delete button.
    assert page.locator("#delete").count() == 0

    # Delete the finished one: confirmed, then the jobs list, and it is gone.
    page.goto(f"/#/jobs/{job_id}")
    page.wait_for_selector("#delete")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete")
    page.wait_for_selector("#jobs-table")
    assert user.get(f"/v1/jobs/{job_id}").status_code == 404
    assert user.get(f"/v1/jobs/{clone_id}").status_code == 200
    assert ui.errors == []
    user.close()


def test_sweeps_list_and_a_sweeps_live_trials_table_and_charts(
    live_server: LiveServer, admin: httpx.Client, open_ui: Any
) -> None:
    from sqlalchemy import update

    from service.db.engine import Database
    from service.db.models import Node
    from tests.service.test_sweeps import _body, _report, _trial_jobs

    token, owner = _user(admin, "sweeper")
    register_node(admin, worker_token(admin), "sweep-node", units=1)
    db = Database(live_server.settings.sqlalchemy_url)
    try:
        with db.transaction() as session:
            # Seen (jobs are accepted) but not ready: the test moves the trials along itself.
            session.execute(update(Node).where(Node.name == "sweep-node").values(status="lost"))
        dataset = insert_dataset(live_server.settings, owner)
        r = admin.post("/v1/sweeps", json=_body(dataset, max_trials=3), headers=auth(token))
        assert r.status_code == 201, r.text
        sweep = r.json()
        first, second = _trial_jobs(db, sweep["id"])
        _report(db, first.id, [0.3, 0.6], end="succeeded")
        _report(db, second.id, [0.7, 0.9], end="succeeded")
        _wait(lambda: len(_trial_jobs(db, sweep["id"])) == 3, what="the third trial")
        ui = open_ui(live_server.url)
        ui.sign_in(token)
        page = ui.page
        page.click("#nav-sweeps")
        listed = page.locator(f"#sweeps-table tr[data-id='{sweep['id']}']")
        listed.wait_for()
        # The objective is an accuracy: in %, as everywhere in the UI.
        assert listed.locator("td").nth(4).text_content() == "90.0%"
        page.click(f"#sweeps-table tr[data-id='{sweep['id']}'] a")
        page.wait_for_selector("#trials-table")
        rows = page.locator("#trials-table tbody tr")
        assert rows.count() == 3
        assert "Best: trial 1, val.top1 90.0%" in (page.text_content("#sweep-best") or "")
        # One chart against the trial number and one per parameter, a point per scored trial.
        assert page.locator("#sweep-charts svg.scatter[data-points='2']").count() == 3
        # Each on proper axes: 5 or more ticks up the side (in %), whole trial numbers, no point
        # on an axis, and the best trial a ring around its dot (which stays drawn).
        for chart in page.locator("#sweep-charts svg.scatter").all():
            y_ticks = chart.locator(".tick-y").all_text_contents()
            assert len(y_ticks) >= 5 and all(t.endswith("%") for t in y_ticks), y_ticks
            assert chart.locator("circle.dot").count() == 2
            assert chart.locator("circle.best-ring").count() == 1
        trial_ticks = page.locator("#chart-trial-number .tick-x").all_text_contents()
        assert trial_ticks and all(t.isdigit() for t in trial_ticks), trial_ticks
        inside = page.evaluate(
            """() => [...document.querySelectorAll('#sweep-charts svg.scatter')].every((svg) => {
                const area = svg.querySelector('rect.plot-area').getBBox();
                return [...svg.querySelectorAll('circle.dot')].every((c) => {
                    const [x, y] = [+c.getAttribute('cx'), +c.getAttribute('cy')];
                    return x - area.x >= 5 && area.x + area.width - x >= 5 && y - area.y >= 5
                        && area.y + area.height - y >= 5;
                });
            })"""
        )
        assert inside
        ring = "getComputedStyle(document.querySelector('#chart-trial-number .best-ring')).fill"
        assert page.evaluate(ring) == "none"
        # Each parameter's importance (Optuna's), and parallel coordinates: a line per scored
        # trial across both parameters and the objective, the best one marked.
        page.wait_for_selector("#sweep-importance .importance-row >> nth=1")
        keys = {r.get_attribute("data-key") for r in page.locator("#sweep-importance .importance-row").all()}
        assert keys == {"parameters.learning_rate", "parameters.batch_size"}
        assert page.locator("#sweep-parallel-chart path.pc-line").count() == 2
        assert page.get_attribute("#sweep-parallel-chart", "data-axes") == "3"
        assert page.locator("#sweep-parallel-chart path.pc-line.best").count() == 1
        # Sortable: by value, descending puts the best trial first.
        page.locator("#trials-table th", has_text="Value").click()
        page.locator("#trials-table th", has_text="Value").click()
        assert rows.nth(0).get_attribute("data-number") == "1"
        assert "90.0%" in (rows.nth(0).text_content() or "")
        # Live: the third trial's end shows without reloading.
        third = _trial_jobs(db, sweep["id"])[2]
        _report(db, third.id, [0.95], end="succeeded")
        page.wait_for_selector("#trials-table tr[data-number='2'][data-state='completed']", timeout=30_000)
        page.wait_for_selector("#sweep-charts svg.scatter[data-points='3']")
        page.wait_for_selector("#sweep-parallel-chart[data-lines='3']")
        ui.assert_clean_text()
        assert ui.errors == []
    finally:
        db.dispose()
