"""Regenerate the README's screenshots of the web UI (docs/ui-jobs.png, docs/ui-job.png,
docs/ui-evaluation.png).

Starts ``torchyard serve`` in a temporary data dir, fills it with sample jobs (one
running with a long metric history, written into its database as a training run
leaves it, with its tags and note, plus queued, succeeded, failed and cancelled ones,
and a succeeded evaluation with its results) and photographs the jobs list, the
running job's page and the evaluation's page in headless Chromium (Debian's package,
driven by Playwright).

Usage::

    python bench/ui_screenshots.py            # writes the three pictures into docs/
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
from service.db.models import Attempt, Job
from service.db.types import utcnow

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


# An evaluation of a digits model on 359 validation images, as its worker reports it.
_CONFUSION = [
    [35, 0, 0, 0, 1, 0, 0, 0, 0, 0],
    [0, 35, 0, 0, 0, 0, 0, 0, 1, 0],
    [0, 0, 35, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 35, 0, 1, 0, 0, 1, 0],
    [0, 1, 0, 0, 35, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 36, 0, 0, 0, 1],
    [0, 0, 0, 0, 0, 0, 36, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 35, 0, 1],
    [0, 2, 0, 1, 0, 0, 0, 0, 32, 0],
    [0, 0, 0, 1, 0, 1, 0, 0, 1, 33],
]


def evaluation_result() -> dict[str, object]:
    classes = [str(d) for d in range(10)]
    n = sum(map(sum, _CONFUSION))
    right = sum(_CONFUSION[i][i] for i in range(10))
    per_class = []
    for i, label in enumerate(classes):
        predicted = sum(row[i] for row in _CONFUSION)
        support = sum(_CONFUSION[i])
        precision = _CONFUSION[i][i] / predicted if predicted else 0.0
        recall = _CONFUSION[i][i] / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        scores = {"precision": precision, "recall": recall, "f1": f1}
        per_class.append({"label": label, **scores, "support": support})
    return {
        "num_images": n,
        "loss": 0.1043,
        "top1": right / n,
        "top5": 1.0,
        "classes": classes,
        "per_class": per_class,
        "confusion_matrix": _CONFUSION,
    }


def write_evaluation(service: Service, owner: str, dataset: str) -> str:
    """A succeeded evaluation job as its worker's report leaves it."""
    figures = evaluation_result()
    best = {"val.loss": figures["loss"], "val.top1": figures["top1"], "val.top5": figures["top5"]}
    spec = {
        "type": "evaluate",
        "name": "evaluate-digits-1-digits-val",
        "model": "digits:1",
        "dataset": dataset,
        "batch_size": 64,
        "priority": 0,
        "resources": {"node_count": 1, "process_count_per_node": 1},
    }
    db = Database(service.database_url)
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
                result={
                    "attempt": 1,
                    "best_epoch": 0,
                    "best": best,
                    "final": None,
                    "stopped_early": False,
                    "epochs_run": 0,
                    "evaluation": figures,
                },
                created_at=now - timedelta(minutes=3),
                updated_at=now,
                scheduled_at=now - timedelta(minutes=3),
                started_at=now - timedelta(minutes=3),
                finished_at=now - timedelta(minutes=2),
            )
            session.add(job)
            session.flush()
            session.add(
                Attempt(
                    job_id=job.id,
                    number=1,
                    status="succeeded",
                    master_addr="10.0.0.1",
                    master_port=29500,
                    started_at=now - timedelta(minutes=3),
                    finished_at=now - timedelta(minutes=2),
                )
            )
            return job.id
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
        # Its tags and note, as its owner would set them on its page.
        labels = {"tags": ["baseline", "long-run"], "note": "The reference run for the next sweep."}
        user.patch(f"/v1/jobs/{running}", json=labels).raise_for_status()
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

        settle(
            service,
            submit("flowers-resnet50"),
            "succeeded",
            42,
            model_sha256="a" * 64,
            best={"attempt": 1, "epoch": 27, "val.loss": 0.412, "val.top1": 0.9134, "val.top5": 0.9872},
        )
        evaluation = write_evaluation(service, owner, train)
        settle(
            service,
            submit("flowers-lr-sweep-3"),
            "failed",
            7,
            failure_code="TrainingDivergedError",
            failure_message="train.loss became nan at epoch 2 step 180: try a lower learning_rate",
            failure_rank=0,
            failure_node="gpu-b",
        )
        user.post(f"/v1/jobs/{submit('digits-quick')}/cancel").raise_for_status()
        submit("flowers-2-nodes", node_count=2)  # placed on both nodes
        submit("flowers-big-batch", node_count=2)  # waits for them

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
            page.set_viewport_size({"width": 1280, "height": 900})
            page.goto(f"/#/jobs/{evaluation}")
            page.wait_for_selector("#confusion-matrix")
            page.wait_for_timeout(500)
            page.screenshot(path=str(args.out / "ui-evaluation.png"))
            browser.close()
        print(f"wrote ui-jobs.png, ui-job.png and ui-evaluation.png into {args.out}")
    finally:
        service.stop()


if __name__ == "__main__":
    main()
