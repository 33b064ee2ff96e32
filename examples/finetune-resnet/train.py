"""Transfer learning with a torchvision ResNet, distributed with DDP: a plain PyTorch
training script (any class-folder images; the example runs it on the demo's digits),
written for torchyard script jobs.

Run it as a script job (one process per unit, the launch variables set by the agent):

    torchyard code upload examples/finetune-resnet
    torchyard submit spec.json        # see README.md

or locally, on one machine, with torchrun:

    TORCHYARD_INPUT_TRAIN=data/train TORCHYARD_INPUT_VAL=data/val \\
        torchrun --nproc-per-node 2 train.py --num_epochs 2

The data are two class-folder datasets (inputs ``train`` and ``val``). The model is
written to ``./outputs/model.pt`` with ``classes.json``, and as a torchyard model
directory to ``./outputs/model/`` (``torchyard.modeldir.save_model_dir``: weights,
config, ONNX export), which registers as a model version:

    torchyard model register digits-finetune --job <job id> --path model

The loss, accuracy and speed go to the job's metrics through ``torchyard.run.log_metric``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms

try:
    from torchyard import run
except ImportError:  # run.py is standard-library only: a copy beside this file works too
    import run  # type: ignore[no-redef]

try:
    from torchyard.modeldir import save_model_dir
except ImportError:  # torchyard not installed: only model.pt and classes.json are written
    save_model_dir = None  # type: ignore[assignment]

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="fine-tune a ResNet on a class-folder dataset")
    parser.add_argument("--num_epochs", type=int, default=25)
    parser.add_argument("--batch_size", type=int, default=16, help="per process")
    parser.add_argument("--learning_rate", type=float, default=0.001)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument(
        "--pretrained", action="store_true", help="start from ImageNet weights (offline cache)"
    )
    parser.add_argument("--output_dir", default=None, help="default: TORCHYARD_OUTPUT_DIR or ./outputs")
    return parser.parse_args()


def setup() -> tuple[int, int, torch.device]:
    """DDP over the launch variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT...)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world > 1 or "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world)
    return rank, world, device


def loaders(args: argparse.Namespace, world: int, rank: int) -> tuple[DataLoader, DataLoader, list[str]]:
    size = args.image_size
    normalize = transforms.Normalize(MEAN, STD)
    train_tf = transforms.Compose(
        [transforms.RandomResizedCrop(size, scale=(0.7, 1.0)), transforms.ToTensor(), normalize]
    )
    # Validation as the service preprocesses the images it scores: resize the shorter side
    # to size / 0.875, centre crop (the model directory's evaluation transform).
    val_tf = transforms.Compose(
        [
            transforms.Resize(int(size / 0.875)),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            normalize,
        ]
    )
    train_set = torchvision.datasets.ImageFolder(os.environ["TORCHYARD_INPUT_TRAIN"], train_tf)
    val_set = torchvision.datasets.ImageFolder(os.environ["TORCHYARD_INPUT_VAL"], val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False)
    return (
        DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler),
        DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler),
        train_set.classes,
    )


def all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def main() -> None:
    args = parse_args()
    rank, world, device = setup()
    train_loader, val_loader, classes = loaders(args, world, rank)
    weights = "DEFAULT" if args.pretrained else None
    model = torchvision.models.get_model(args.arch, weights=weights)
    model.fc = nn.Linear(model.fc.in_features, len(classes))  # the new head for our classes
    model = model.to(device)
    ddp = DistributedDataParallel(model) if dist.is_initialized() else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.learning_rate * world, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.1)
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    final: dict[str, float] = {}
    for epoch in range(args.num_epochs):
        train_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        ddp.train()
        started, seen = time.perf_counter(), 0
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp(images), labels)
            loss.backward()
            optimizer.step()
            seen += len(images)
            if rank == 0:
                run.log_metric("train.loss", loss.item(), step=step, epoch=epoch)
            step += 1
        scheduler.step()
        speed = all_sum([seen / (time.perf_counter() - started)], device)[0]
        ddp.eval()
        correct = total = loss_sum = 0.0
        with torch.no_grad():
            for images, labels in val_loader:
                images, labels = images.to(device), labels.to(device)
                logits = ddp(images)
                loss_sum += loss_fn(logits, labels).item() * len(images)
                correct += (logits.argmax(1) == labels).sum().item()
                total += len(images)
        correct, total, loss_sum = all_sum([correct, total, loss_sum], device)
        final = {"val.top1": correct / total, "val.loss": loss_sum / total}
        if rank == 0:
            run.log_metric("val.top1", correct / total, step=step, epoch=epoch)
            run.log_metric("val.loss", loss_sum / total, step=step, epoch=epoch)
            run.log_metric("train.images_per_sec", speed, step=step, epoch=epoch)
            print(
                f"epoch {epoch}: val acc {correct / total:.4f}, loss {loss_sum / total:.4f}, {speed:.0f} img/s",
                flush=True,
            )
    if rank == 0:
        out = Path(args.output_dir) if args.output_dir else run.output_dir()
        out.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), out / "model.pt")
        (out / "classes.json").write_text(json.dumps(classes))
        print(f"model saved to {out / 'model.pt'}", flush=True)
        if save_model_dir is not None:
            example = next(iter(val_loader))[0][:4]  # the ONNX export is checked on these
            save_model_dir(
                out / "model",
                model,
                architecture=args.arch,
                classes=classes,
                image_size=args.image_size,
                mean=MEAN,
                std=STD,
                metrics={"final": final, "epochs_run": args.num_epochs},
                example=example,
            )
            print(f"model directory written to {out / 'model'}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
