"""A plain torchrun DDP training script: the baseline the trainer's throughput is compared with.

It does the same work as a torchyard job, written the way a hand-made script would be:
torchvision ``ImageFolder`` + ``get_model``, ``DistributedSampler``, DDP, SGD (momentum
0.9, weight decay 1e-4, lr x world size), the "light" augmentation (mild random resized
crop, no flip), ImageNet normalization, validation after every epoch, bf16 autocast and
channels_last on CUDA. It prints the training images/sec of every epoch (all ranks'
images over the epoch's training time) and their mean over the epochs after the first.

    torchrun --standalone --nproc-per-node 2 bench/plain_torchrun.py --data DIGITS_ROOT
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train/ and val/ class folders")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    torch.manual_seed(1)

    normalize = transforms.Normalize(MEAN, STD)
    train_tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(args.image_size, scale=(0.8, 1.0), ratio=(0.9, 1.1)),
            transforms.ToTensor(),
            normalize,
        ]
    )
    val_tf = transforms.Compose(
        [
            transforms.Resize(int(args.image_size / 0.875)),
            transforms.CenterCrop(args.image_size),
            transforms.ToTensor(),
            normalize,
        ]
    )
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler: DistributedSampler[object] = DistributedSampler(
        train_set, num_replicas=world, rank=rank, shuffle=True
    )
    cuda = device.type == "cuda"
    loader_args = {"num_workers": args.workers, "pin_memory": cuda, "persistent_workers": args.workers > 0}
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, **loader_args
    )
    val_loader = DataLoader(
        val_set,
        batch_size=args.batch_size,
        sampler=DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False),
        **loader_args,
    )

    model = torchvision.models.get_model(args.arch, weights=None, num_classes=len(train_set.classes)).to(
        device
    )
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    lr = args.lr * world
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total))
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    rates = []
    # Non-finite losses are counted on the device and checked once an epoch: no sync per step.
    bad_steps = torch.zeros((), dtype=torch.int64, device=device)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        ddp.train()
        started, images = time.perf_counter(), 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            with autocast():
                loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            bad_steps += (~torch.isfinite(loss.detach())).long()
            _mark_first_step(rank, epoch, images)
            images += y.shape[0]
        if bad_steps.item():
            raise RuntimeError("loss is not finite")
        elapsed = time.perf_counter() - started
        count = torch.tensor([float(images)], dtype=torch.float64, device=device)
        dist.all_reduce(count)
        rate = float(count.item()) / elapsed
        rates.append(rate)

        ddp.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                with autocast():
                    logits = ddp.module(x).float()
                sums += torch.stack(
                    [
                        F.cross_entropy(logits, y, reduction="sum").double(),
                        (logits.argmax(1) == y).sum().double(),
                        torch.tensor(len(y), device=device),
                    ]
                )
        dist.all_reduce(sums)
        if rank == 0:
            print(
                f"epoch {epoch}: {rate:.1f} images/sec, val loss {sums[0] / sums[2]:.4f}, "
                f"val top1 {sums[1] / sums[2]:.4f}",
                flush=True,
            )
    if rank == 0:
        steady = rates[1:] or rates
        print(f"plain images/sec: {sum(steady) / len(steady):.1f}", flush=True)
    dist.destroy_process_group()


def _mark_first_step(rank: int, epoch: int, images_before: int) -> None:
    """Rank 0 prints when its first optimizer step is done (bench_slurm.py reads the time)."""
    if rank == 0 and epoch == 1 and images_before == 0:
        print(f"first step done at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
