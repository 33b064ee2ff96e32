"""An upload being received from a worker: written to a staging file and hashed as it arrives,
size-capped. One class per kind of upload, so that each store's publication takes only its
own: a model archive, a job's outputs archive, a checkpoint."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO, ClassVar

from torchyard.contract.errors import PayloadTooLargeError


class IncomingUpload:
    """An upload being received: written to disk and hashed as it arrives, size-capped."""

    what: ClassVar[str] = "upload"

    def __init__(self, path: Path, fh: BinaryIO, max_bytes: int) -> None:
        self.path = path
        self._fh = fh
        self._digest = hashlib.sha256()
        self.size = 0
        self.max_bytes = max_bytes

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            raise PayloadTooLargeError(f"{self.what} exceeds the limit of {self.max_bytes} bytes")
        self._digest.update(data)
        self._fh.write(data)

    def finish(self) -> str:
        """Flush to disk; the sha256 of what arrived."""
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return self._digest.hexdigest()

    def discard(self) -> None:
        """Remove the temporary file (a no-op once it was published)."""
        if not self._fh.closed:
            self._fh.close()
        self.path.unlink(missing_ok=True)


class IncomingModelArchive(IncomingUpload):
    """A job's model directory as a tar.gz, from node rank 0 (:mod:`service.services.artifacts`)."""

    what = "model archive"


class IncomingOutputs(IncomingUpload):
    """A script job's outputs archive, from a node (:mod:`service.services.outputs`)."""

    what = "outputs archive"


class IncomingCheckpoint(IncomingUpload):
    """A training checkpoint, from node rank 0 (:mod:`service.services.checkpoints`)."""

    what = "checkpoint"
