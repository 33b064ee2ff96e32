"""Regenerate the README's screenshots of the web UI (docs/ui-jobs.png, docs/ui-job.png).

Starts ``torchyard serve`` in a temporary data dir, fills it with sample jobs (one
running with a long metric history, written into its database as a training run
leaves it, plus queued, succeeded, failed and cancelled ones) and photographs the
jobs list and the running job's page in headless Chromium (Debian's package, driven
by Playwright).

Usage::

    python bench/ui_screenshots.py            # writes docs/ui-jobs.png and docs/ui-job.png
    python bench/ui_screenshots.py --out /tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
from datetime import timedelta
from pathlib import Path

import httpx
from bench_ui import Service, write_job
from sqlalchemy import select

from service.db.engine import Database
from service.db.models import Job, utcnow

ROOT = Path(__file__).resolve().parents[1]


def settle(service: Service, job_id: str, status: str, minutes: float, **fields: object) -> None:
    """Move a sample job to a final status, as its run would have left it."""
    db = Database(service.database_url)
    try:
        with db.transaction() as session:
            job = session.scalars(select(Job).where(Job.id == job_id)).one()
            now = utcnow()
            job.status = status
            job.scheduled_at = job.started_at = now - timedelta(minutes=minutes)
            job.finished_at = job.updated_at = now
            job.wait_reason = None
            for key, value in fields.items():
                setattr(job, key, value)
    finally:
        db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    # The sample nodes never heartbeat: a long lease keeps them ready for the pictures.
    service = Service({"TORCHYARD_LEASE_TIMEOUT_S": "3600"})
    try:
        admin = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.admin_token}"})
        worker = admin.post("/v1/tokens", json={"name": "nodes", "role": "worker"}).json()["token"]
        for name in ("gpu-a", "gpu-b"):
            httpx.post(
                f"{service.url}/v1/worker/nodes",
                json={"name": name, "address": "10.0.0.1", "units": 4, "accelerator": "cuda"},
                headers={"Authorization": f"Bearer {worker}"},
            ).raise_for_status()
        token = admin.post("/v1/tokens", json={"name": "alice", "role": "user"}).json()["token"]
        user = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        owner = user.get("/v1/whoami").json()["id"]
        running = write_job(service, owner, 40_000)
        spec = user.get(f"/v1/jobs/{running}").json()
        train = spec["train_dataset"]

        def submit(name: str, **resources: int) -> str:
            body = {
                "name": name,
                "model": {"architecture": "resnet50"},
                "train_dataset": train,
                "validation_dataset": train,
                "parameters": {"epochs": 30, "image_size": 224},
                "resources": {"node_count": 1, "process_count_per_node": 4, **resources},
            }
            r = user.post("/v1/jobs", json=body)
            r.raise_for_status()
            job_id: str = r.json()["id"]
            return job_id

        settle(service, submit("flowers-resnet50"), "succeeded", 42, model_sha256="a" * 64)
        settle(
            service,
            submit("birds-lr-sweep-3"),
            "failed",
            7,
            failure_code="TrainingDivergedError",
            failure_message="train.loss became nan at epoch 2 step 180: try a lower learning_rate",
            failure_rank=0,
            failure_node="gpu-b",
        )
        user.post(f"/v1/jobs/{submit('digits-quick')}/cancel").raise_for_status()
        submit("birds-2-nodes", node_count=2)  # placed on both nodes
        submit("birds-big-batch", node_count=2)  # waits for them

        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            extra = ["--no-sandbox"] if os.geteuid() == 0 else []
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True, args=extra)
            page = browser.new_page(base_url=service.url, viewport={"width": 1280, "height": 760})
            page.goto("/")
            page.fill("#token", token)
            page.click("#signin-submit")
            page.wait_for_selector("#jobs-table tbody tr")
            page.wait_for_timeout(1500)  # the queued jobs' waiting reasons
            page.goto("/#/jobs")
            page.wait_for_selector("#jobs-table tbody tr")
            page.screenshot(path=str(args.out / "ui-jobs.png"))
            page.set_viewport_size({"width": 1280, "height": 1000})
            page.goto(f"/#/jobs/{running}")
            page.wait_for_selector("#charts[data-ready='true']")
            page.wait_for_timeout(500)
            page.screenshot(path=str(args.out / "ui-job.png"))
            browser.close()
        print(f"wrote {args.out / 'ui-jobs.png'} and {args.out / 'ui-job.png'}")
    finally:
        service.stop()


if __name__ == "__main__":
    main()
