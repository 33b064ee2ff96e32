"""Models scored outside the API process: a small pool of scoring processes.

A registered model may come from a script job: its graph is untrusted. The API decodes and
crops the images (bounded by the pixel caps), then hands the uint8 batch to one of
``predict_workers`` processes, which loads the model (each keeps its own small cache) and
runs ONNX Runtime under limits:

- memory: the process's address space is capped (``RLIMIT_AS``, ``predict_worker_memory_bytes``);
  a model that asks for more fails in that process, never in the API;
- CPU time: each request may use ``predict_cpu_s`` seconds of CPU (``RLIMIT_CPU``, the
  kernel ends the process past it);
- wall time and the client: past ``predict_timeout_s``, or as soon as the client has gone,
  the process is killed and replaced.

A process that died (killed, or past a limit) is started again for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import resource
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from torchyard.contract.errors import ResourceLimitError

log = logging.getLogger(__name__)

_POLL_S = 0.1


def _serve(conn: Connection, memory_bytes: int, cpu_s: float, max_models: int, max_bytes: int) -> None:
    """The scoring process: one request at a time from ``conn``."""
    import numpy as np

    from torchyard.scoring import ModelCache, normalize, softmax, top_k

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cache = ModelCache(max_models, max_bytes)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        used = int(usage.ru_utime + usage.ru_stime) + 1
        _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        resource.setrlimit(resource.RLIMIT_CPU, (used + max(1, int(cpu_s)), hard))
        try:
            key, folder, batch, k = request
            model = cache.get(key, Path(folder))
            inputs = normalize(np.asarray(batch), model.mean, model.std)
            answer: Any = ("ok", top_k(softmax(model.logits(inputs)), model.classes, k))
        except MemoryError:
            cache = ModelCache(max_models, max_bytes)
            answer = ("limit", f"the model needed more than the scoring memory limit of {memory_bytes} bytes")
        except Exception as exc:  # the model failed: say why, keep serving
            answer = ("error", f"{type(exc).__name__}: {str(exc)[:500]}")
        conn.send(answer)


@dataclass
class _Slot:
    process: Any
    conn: Connection


class ScoringPool:
    """``size`` scoring processes, started on first use; each request holds one."""

    def __init__(
        self,
        size: int,
        *,
        memory_bytes: int,
        cpu_s: float,
        timeout_s: float,
        max_models: int,
        max_bytes: int,
    ) -> None:
        self.size = size
        self.memory_bytes = memory_bytes
        self.cpu_s = cpu_s
        self.timeout_s = timeout_s
        self.max_models = max_models
        self.max_bytes = max_bytes
        self._context = multiprocessing.get_context("spawn")
        self._free: list[_Slot] = []
        self._started = 0
        self._lock = threading.Lock()
        self._available = threading.Semaphore(size)
        self._closed = False

    def _start(self) -> _Slot:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_serve,
            args=(child, self.memory_bytes, self.cpu_s, self.max_models, self.max_bytes),
            name="torchyard-scoring",
            daemon=True,
        )
        process.start()
        child.close()
        return _Slot(process, parent)

    def _take(self) -> _Slot:
        self._available.acquire()
        with self._lock:
            while self._free:
                slot = self._free.pop()
                if slot.process.is_alive():
                    return slot
                slot.conn.close()
        try:
            return self._start()
        except BaseException:
            self._available.release()
            raise

    def _give_back(self, slot: _Slot, healthy: bool) -> None:
        if healthy and not self._closed:
            with self._lock:
                self._free.append(slot)
        else:
            self._kill(slot)
        self._available.release()

    @staticmethod
    def _kill(slot: _Slot) -> None:
        with contextlib.suppress(Exception):
            slot.process.kill()
            slot.process.join(5)
        with contextlib.suppress(Exception):
            slot.conn.close()

    async def predict(
        self,
        key: str,
        folder: Path,
        batch: Any,
        k: int,
        gone: Callable[[], Awaitable[bool]],
    ) -> list[list[tuple[str, float]]]:
        """The top ``k`` labels of each image of ``batch`` (uint8 ``(N, 3, S, S)``); the
        process is killed if ``gone()`` says the client left, or past the timeout."""
        slot = await asyncio.to_thread(self._take)
        healthy = False
        try:
            await asyncio.to_thread(slot.conn.send, (key, str(folder), batch, k))
            deadline = time.monotonic() + self.timeout_s
            while True:
                ready = await asyncio.to_thread(slot.conn.poll, _POLL_S)
                if ready:
                    break
                if not slot.process.is_alive():
                    raise ResourceLimitError(
                        "scoring this model went past its CPU or memory limit (TORCHYARD_PREDICT_CPU_S, "
                        "TORCHYARD_PREDICT_WORKER_MEMORY_BYTES): its process was ended",
                        details={"limit": "cpu_or_memory"},
                    )
                if time.monotonic() > deadline:
                    raise ResourceLimitError(
                        f"scoring took longer than {self.timeout_s:g} s (TORCHYARD_PREDICT_TIMEOUT_S): stopped",
                        details={"limit": "timeout"},
                    )
                if await gone():
                    log.info("predict: the client left; its scoring process is stopped")
                    raise ResourceLimitError("the client left before its answer", details={"limit": "client"})
            try:
                status, value = await asyncio.to_thread(slot.conn.recv)
            except EOFError:
                raise ResourceLimitError(
                    "scoring this model went past its CPU or memory limit: its process was ended",
                    details={"limit": "cpu_or_memory"},
                ) from None
            healthy = status != "limit"
            if status != "ok":
                raise ResourceLimitError(f"the model could not be scored: {value}", details={"limit": status})
            result: list[list[tuple[str, float]]] = value
            return result
        finally:
            self._give_back(slot, healthy)

    def pids(self) -> list[int]:
        with self._lock:
            return [s.process.pid for s in self._free if s.process.is_alive()]

    def close(self) -> None:
        self._closed = True
        with self._lock:
            slots, self._free = self._free, []
        for slot in slots:
            self._kill(slot)
