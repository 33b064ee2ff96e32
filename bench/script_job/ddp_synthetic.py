"""A plain DDP training script (no torchyard import): a small CNN on synthetic images,
timed after a warm-up. Prints its first line before importing torch, and ends with
``images/s: <whole job>``. Used by bench/bench_script_jobs.py both as a script job and
under a bare torchrun."""

import time

print(f"first-line {time.time():.6f}", flush=True)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--result", default=None, help="where to write the figure as JSON")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.batch_size,))
    loss_fn = nn.CrossEntropyLoss()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            started = time.perf_counter()
        opt.zero_grad()
        loss_fn(ddp(images), labels).backward()
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - started
    speed = args.steps * args.batch_size * world / elapsed
    if rank == 0:
        print(f"images/s: {speed:.1f}", flush=True)
        out = args.result or os.path.join(os.environ.get("TORCHYARD_OUTPUT_DIR", "."), "result.json")
        with open(out, "w") as fh:
            json.dump({"images_per_sec": speed, "elapsed_s": elapsed}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
