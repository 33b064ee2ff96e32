"""Untrusted ONNX models: refused at registration by operator, and scored outside the API
process under memory, CPU-time and wall-time limits (service.services.scoring_pool)."""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from service.services.scoring import UploadedImage, check_total_pixels
from service.services.scoring_pool import ScoringPool
from tests.support.onnx_attacks import constant_of_shape_model, loop_model, plain_model, write_model_dir
from torchyard.contract.errors import InvalidModelDirectoryError, PayloadTooLargeError, ResourceLimitError
from torchyard.contract.model_archive import check_model_config
from torchyard.contract.onnx_graph import OnnxGraphError, check_operators


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pool(**kw: float) -> ScoringPool:
    limits = {"memory_bytes": 768 * 1024**2, "cpu_s": 2.0, "timeout_s": 60.0, **kw}
    return ScoringPool(1, max_models=2, max_bytes=10**9, **limits)  # type: ignore[arg-type]


async def _never_gone() -> bool:
    return False


def _batch() -> np.ndarray:
    return np.zeros((2, 3, 32, 32), dtype=np.uint8)


def test_loop_and_constant_of_shape_are_refused_naming_the_operator() -> None:
    check_operators(plain_model().SerializeToString())  # what a classifier exports to passes
    for model, name in ((loop_model(), "'Loop'"), (constant_of_shape_model(), "'ConstantOfShape'")):
        with pytest.raises(OnnxGraphError, match=name):
            check_operators(model.SerializeToString())
    with pytest.raises(OnnxGraphError, match="not a valid ONNX"):
        check_operators(b"\x0a\xff\xff")


def test_image_size_is_bounded_as_training_is() -> None:
    config = {"format_version": 1, "architecture": "resnet18", "classes": ["a", "b"], "num_classes": 2}
    config["image_size"] = 4096
    with pytest.raises(InvalidModelDirectoryError, match="image_size"):
        check_model_config(config, ["config.json"])
    check_model_config({**config, "image_size": 1024}, ["config.json"])


def test_the_pixel_cap_counts_the_pixels_after_resizing() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    tiny = [UploadedImage(f"{n}.png", buf.getvalue()) for n in range(2)]
    check_total_pixels(tiny, 4096 * 4096, 16 * 4096 * 4096)  # two pixels as sent
    # A model of input size 1024 upscales each to 1170 x 1170 before cropping.
    with pytest.raises(PayloadTooLargeError) as refused:
        check_total_pixels(tiny, 4096 * 4096, 2 * 1024 * 1024, image_size=1024)
    assert refused.value.details["pixels"] == 2 * 1170 * 1170


def test_hostile_models_are_bounded_in_their_own_process_and_the_api_stays_small(tmp_path: Path) -> None:
    plain = write_model_dir(tmp_path / "plain", plain_model())
    looping = write_model_dir(tmp_path / "loop", loop_model(10**9))
    huge = write_model_dir(tmp_path / "cos", constant_of_shape_model())
    pool = _pool()
    try:
        before = _rss_bytes()
        ok = asyncio.run(pool.predict("plain", plain, _batch(), 2, _never_gone))
        # Black images, normalized: channel c is the least negative.
        assert [[label for label, _ in row] for row in ok] == [["c", "b"], ["c", "b"]]
        first = pool.pids()
        assert len(first) == 1 and first[0] != os.getpid()  # scored in another process
        # 10^9 iterations: past its 2 s of CPU, the kernel ends the process.
        with pytest.raises(ResourceLimitError, match="CPU or memory limit"):
            asyncio.run(pool.predict("loop", looping, _batch(), 2, _never_gone))
        # 1 GiB from a few bytes: over the process's 768 MiB, it fails there.
        with pytest.raises(ResourceLimitError):
            asyncio.run(pool.predict("cos", huge, _batch(), 2, _never_gone))
        # The API process grew by none of it; the next request is scored by a fresh process.
        assert _rss_bytes() - before < 200 * 1024**2
        assert asyncio.run(pool.predict("plain", plain, _batch(), 1, _never_gone))[0][0][0] == "c"
        assert pool.pids() and pool.pids()[0] not in first
    finally:
        pool.close()


def test_a_request_whose_client_left_or_timed_out_has_its_process_killed(tmp_path: Path) -> None:
    looping = write_model_dir(tmp_path / "loop", loop_model(10**9))
    pool = _pool(cpu_s=600.0, timeout_s=600.0)

    async def gone_soon() -> bool:
        await asyncio.sleep(0.5)
        return True

    try:
        with pytest.raises(ResourceLimitError, match="client left"):
            asyncio.run(pool.predict("loop", looping, _batch(), 2, gone_soon))
        assert pool.pids() == []  # killed, not kept
        short = _pool(cpu_s=600.0, timeout_s=1.0)
        try:
            with pytest.raises(ResourceLimitError, match="longer than 1 s"):
                asyncio.run(short.predict("loop", looping, _batch(), 2, _never_gone))
            assert short.pids() == []
        finally:
            short.close()
    finally:
        pool.close()
