"""A node's pretrained weights: the service's stored state dicts, cached and verified per node,
or the model hub's default weights where the node may download them (docs/fine-tuning.md).

A stored file is downloaded once per node into ``<cache>/<sha256>.pth``: written to a
staging name while it is hashed, checked against the sha256 of the claim, and moved in
place with one rename. Two fetchers of the same file on one node serialise on a lock file.

With ``TORCHYARD_WORKER_PRETRAINED_FROM_HUB=1`` the node says so when it registers (the
service then accepts ``pretrained`` jobs without stored weights) and, for a job whose
architecture has none stored, downloads torchvision's default weights through torch hub
(its own hash check) into the hub folder the ranks read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import httpx

from torchyard.apiclient import direct
from torchyard.contract.errors import InvalidModelDirectoryError, error_from_body
from torchyard.contract.files import locked
from torchyard.contract.headers import SHA256_HEADER
from torchyard.contract.protocol import ClaimedWeights

log = logging.getLogger(__name__)

HUB_ENV = "TORCHYARD_WORKER_PRETRAINED_FROM_HUB"
# The key of the node's registration info the service looks for.
HUB_INFO_KEY = "pretrained_from_hub"
_CHUNK = 1024 * 1024


def hub_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this node downloads default weights from the model hub."""
    return environ.get(HUB_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _download(client: httpx.Client, ref: ClaimedWeights, dest: Path) -> str:
    digest = hashlib.sha256()
    # Object storage: a redirect to the file in the store, followed; the API's headers say
    # what it is, and the bytes are hashed here whoever sends them.
    url = f"/v1/worker/weights/{ref.id}/file"
    with client.stream("GET", url, follow_redirects=True) as response:
        if response.status_code != 200:
            response.read()
            try:
                body: object = response.json()
            except ValueError:
                body = response.text
            raise error_from_body(response.status_code, body)
        announced = direct.api_headers(response).get(SHA256_HEADER)
        if announced != ref.sha256:
            raise InvalidModelDirectoryError(
                f"weights {ref.id}: the service sends content {announced!r}, the job expects {ref.sha256!r}"
            )
        with open(dest, "wb") as out:
            for chunk in response.iter_bytes(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    return digest.hexdigest()


def fetch_weights(client: httpx.Client, ref: ClaimedWeights, cache_dir: Path) -> Path:
    """The node's verified copy of stored weights, downloading them if needed.

    ``client`` is an httpx client with the API's base URL and the worker token. A copy
    whose sha256 is not the claim's raises InvalidModelDirectoryError and is not kept.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"{ref.sha256}.pth"
    if final.is_file():
        return final
    with locked(cache_dir / f".{ref.sha256}.lock"):
        if final.is_file():
            return final  # another fetcher finished while we waited
        part = cache_dir / f".{ref.sha256}-{uuid.uuid4().hex}.part"
        try:
            got = _download(client, ref, part)
            if got != ref.sha256:
                raise InvalidModelDirectoryError(
                    f"weights {ref.id}: downloaded content has checksum {got}, expected {ref.sha256}"
                )
            os.rename(part, final)
        finally:
            part.unlink(missing_ok=True)
    log.info("weights %s (%s, %s) cached in %s", ref.id, ref.architecture, ref.filename, final)
    return final


def fetch_hub_weights(architecture: str) -> Path:
    """torchvision's default weights of ``architecture``, downloaded through torch hub (which
    checks the hash in the file name) into this environment's hub folder, if not there yet."""
    import torch
    import torchvision

    weights = torchvision.models.get_model_weights(architecture).DEFAULT
    torch.hub.load_state_dict_from_url(weights.url, progress=False, check_hash=True, weights_only=True)
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    log.info("default weights of %s from the model hub: %s", architecture, path)
    return path
