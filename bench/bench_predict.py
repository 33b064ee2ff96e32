"""Scoring speed on CPU: torch eager against ONNX Runtime, in the same run (docs/models.md).

For each image size (32 and 224 px) a resnet18 with 10 classes (random weights: speed
does not depend on them) is exported to ONNX exactly as the trainer exports it
(``torchyard.modeldir.export_onnx``) and loaded with the session options the API
scores with (``torchyard.scoring.session_options``), then both engines score the same preprocessed
batches of 1 and 32 images, alternating run by run so that load changes on a shared
machine hit both alike. Both use the same number of threads (``--threads``, default
every core). Reported per engine and batch: images/s and the p50/p99 latency of one
batch, plus ONNX Runtime's speed-up over torch eager. A second table times the whole
API-side path for batch 1 (decode a PNG, preprocess with Pillow/NumPy, ONNX Runtime,
softmax, top-3), which is what a predict request costs beyond HTTP.

Run: ``python bench/bench_predict.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image

from torchyard.modeldir import export_onnx
from torchyard.scoring import OnnxModel


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _time_calls(fn: object, inputs: object, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(inputs)  # type: ignore[operator]
        out.append(time.perf_counter() - started)
    return out


def bench_size(size: int, threads: int, repeats: dict[int, int], work: Path) -> list[dict[str, object]]:
    torch.manual_seed(0)
    model = torchvision.models.get_model("resnet18", weights=None, num_classes=10).eval()
    folder = work / f"m{size}"
    folder.mkdir()
    example = torch.randn(2, 3, size, size)
    export_onnx(model, example, folder / "model.onnx")
    config = {"classes": [str(i) for i in range(10)], "image_size": size}
    (folder / "config.json").write_text(json.dumps(config))
    onnx_model = OnnxModel.load(folder, threads=threads)
    rows = []
    for batch in (1, 32):
        x = torch.randn(batch, 3, size, size)
        x_np = x.numpy()

        @torch.inference_mode()
        def eager(inp: torch.Tensor) -> object:
            return model(inp)

        def ort(inp: np.ndarray) -> object:
            return onnx_model.logits(inp)

        for _ in range(3):  # warm-up
            eager(x)
            ort(x_np)
        n = repeats[batch]
        t_eager: list[float] = []
        t_ort: list[float] = []
        for _ in range(n):  # alternate, so that load changes hit both alike
            t_eager += _time_calls(eager, x, 1)
            t_ort += _time_calls(ort, x_np, 1)
        for engine, times in (("torch eager", t_eager), ("onnxruntime", t_ort)):
            rows.append(
                {
                    "size": size,
                    "batch": batch,
                    "engine": engine,
                    "images_per_s": batch * len(times) / sum(times),
                    "p50_ms": 1000 * statistics.median(times),
                    "p99_ms": 1000 * _percentile(times, 0.99),
                }
            )
    return rows


def bench_api_path(size: int, threads: int, repeats: int, work: Path) -> dict[str, float]:
    """Batch 1 through the API's scoring path: PNG decode, preprocessing, ORT, top-3."""
    onnx_model = OnnxModel.load(work / f"m{size}", threads=threads)
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    data = buf.getvalue()

    def once(_: object) -> object:
        with Image.open(io.BytesIO(data)) as im:
            image = im.convert("RGB")
        return onnx_model.predict([image], 3)

    for _ in range(3):
        once(None)
    times = _time_calls(once, None, repeats)
    return {"p50_ms": 1000 * statistics.median(times), "p99_ms": 1000 * _percentile(times, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--repeats", type=int, default=200, help="timed batches of 1 (batches of 32: a tenth)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = {1: args.repeats, 32: max(10, args.repeats // 10)}
    print(f"torch {torch.__version__}, threads {args.threads}, load average {os.getloadavg()[0]:.1f}")
    print("| size | batch | engine | images/s | p50 ms | p99 ms | ORT / torch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for size in (32, 224):
            rows = bench_size(size, args.threads, repeats, work)
            for i in range(0, len(rows), 2):
                eager, ort = rows[i], rows[i + 1]
                speedup = float(ort["images_per_s"]) / float(eager["images_per_s"])  # type: ignore[arg-type]
                for row, note in ((eager, ""), (ort, f"{speedup:.2f}×")):
                    print(
                        f"| {row['size']} | {row['batch']} | {row['engine']} | {row['images_per_s']:.1f} "
                        f"| {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {note} |"
                    )
        print()
        print("API scoring path, batch 1 (PNG decode + preprocessing + ONNX Runtime + top-3):")
        for size in (32, 224):
            r = bench_api_path(size, args.threads, args.repeats, work)
            print(f"  {size} px: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
