"""HTTP header names of the worker protocol and the artifact routes."""

from __future__ import annotations

# The placement's lease token, on every write an agent makes for an attempt (stale: 409).
LEASE_HEADER = "X-Torchyard-Lease"
# sha256 of an archive's bytes: model uploads, dataset and model downloads.
SHA256_HEADER = "X-Torchyard-Sha256"
# The agent's per-node key, sent at registration and on heartbeats and claims.
AGENT_KEY_HEADER = "X-Torchyard-Agent-Key"
# The training-state checkpoint's epoch (and step, for a mid-epoch preemption checkpoint).
CHECKPOINT_EPOCH_HEADER = "X-Torchyard-Checkpoint-Epoch"
CHECKPOINT_STEP_HEADER = "X-Torchyard-Checkpoint-Step"
# A dataset's or code package's download: how many files it holds and their bytes once
# extracted (a node caps its extraction of a stored archive at about these).
FILES_HEADER = "X-Torchyard-Files"
CONTENT_BYTES_HEADER = "X-Torchyard-Content-Bytes"
