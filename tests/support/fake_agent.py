"""A scripted worker agent over the real worker HTTP routes, for tests that need a job's
statuses, metrics, logs and model without training anything."""

from __future__ import annotations

import contextlib
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import torch

from torchyard.contract.model_archive import SHA256_HEADER, pack_model_dir
from torchyard.modeldir import write_model_dir

LEASE = "X-Torchyard-Lease"


class FakeAgent:
    def __init__(self, url: str, worker_token: str, name: str = "fake-node", units: int = 2) -> None:
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {worker_token}"}, timeout=30
        )
        self.name = name
        self.units = units
        r = self.http.post(
            "/v1/worker/nodes",
            json={"name": name, "address": "127.0.0.1", "units": units, "accelerator": "cpu"},
        )
        assert r.status_code == 200, r.text
        self.leases: set[str] = set()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, daemon=True)
        self._beat.start()

    def _heartbeats(self) -> None:
        """Keep the node and its leases alive, as a real agent does."""
        with httpx.Client(
            base_url=str(self.http.base_url), headers=dict(self.http.headers), timeout=30
        ) as http:
            while not self._stop.wait(1.0):
                with contextlib.suppress(httpx.HTTPError):
                    http.post(f"/v1/worker/nodes/{self.name}/heartbeat", json={"leases": sorted(self.leases)})

    def close(self) -> None:
        self._stop.set()
        self._beat.join(10)
        self.http.close()

    def claim(self, wait: float = 10.0) -> dict[str, Any]:
        r = self.http.post(f"/v1/worker/nodes/{self.name}/claim", params={"wait": wait})
        assert r.status_code == 200, (r.status_code, r.text)
        placement: dict[str, Any] = r.json()
        self.leases.add(placement["lease_token"])
        return placement

    def status(self, placement: dict[str, Any], state: str, **extra: Any) -> dict[str, Any]:
        r = self.http.post(
            "/v1/worker/placements/status",
            json={"state": state, **extra},
            headers={LEASE: placement["lease_token"]},
        )
        assert r.status_code == 200, r.text
        if state != "running":
            self.leases.discard(placement["lease_token"])
        body: dict[str, Any] = r.json()
        return body

    def report(self, placement: dict[str, Any], **batch: Any) -> None:
        r = self.http.post(
            f"/v1/worker/jobs/{placement['job_id']}/reports",
            json=batch,
            headers={LEASE: placement["lease_token"]},
        )
        assert r.status_code == 200, r.text

    def log(self, placement: dict[str, Any], stream: str, offset: int, text: str) -> int:
        """Send one log chunk; the offset after it."""
        self.report(placement, logs=[{"stream": stream, "offset": offset, "data": text}])
        return offset + len(text.encode())

    def metric(self, placement: dict[str, Any], name: str, value: float, epoch: int, step: int) -> None:
        point = {"name": name, "value": value, "epoch": epoch, "step": step, "rank": 0, "time": now()}
        self.report(placement, metrics=[point])

    def upload_model(self, placement: dict[str, Any], classes: list[str]) -> str:
        """Upload a small untrained model directory (mobilenet_v3_small); its archive's sha256."""
        with tempfile.TemporaryDirectory() as tmp:
            import torchvision

            torch.manual_seed(0)
            model = torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=len(classes))
            folder = write_model_dir(
                Path(tmp) / "model",
                model,
                {"architecture": "mobilenet_v3_small", "classes": classes, "image_size": 32},
                {"best": {"val.top1": 0.5}},
            )
            archive = Path(tmp) / "model.tar.gz"
            sha, _size = pack_model_dir(folder, archive)
            r = self.http.put(
                f"/v1/worker/jobs/{placement['job_id']}/model",
                content=archive.read_bytes(),
                headers={
                    LEASE: placement["lease_token"],
                    SHA256_HEADER: sha,
                    "Content-Type": "application/gzip",
                },
            )
            assert r.status_code == 200, r.text
            return sha


def now() -> str:
    return datetime.now(UTC).isoformat()
