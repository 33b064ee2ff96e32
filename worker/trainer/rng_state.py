"""Every random generator of one rank, captured and restored as plain tensors and lists.

A mid-epoch checkpoint holds each rank's state (gathered to rank 0) so that a resumed
rank draws exactly the numbers it would have drawn without the interruption. The
values are tensors and Python scalars only, so ``torch.load(weights_only=True)`` reads them.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), numpy and python ``random`` states."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": int(version), "internal": [int(v) for v in internal], "gauss": gauss},
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what :func:`capture` returned (CUDA states only where CUDA is in use)."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            int(np_state["pos"]),
            int(np_state["has_gauss"]),
            float(np_state["cached_gaussian"]),
        )
    )
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["internal"]), py["gauss"]))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
