"""Training step time with cube_torch's DevicePrefetcher against the two ways it replaces.

    .venv/bin/python -m benchmarks.device_prefetch [--device cuda] [--batch 256] [--markdown]

ResNet-18 forward and backward (SGD) on ``uint8`` 3x224x224 images, normalised on the
device, fed three ways in one run:

1. **resident**: one batch already on the device, normalised once, every step: the model's
   own step time, the floor no loader can beat;
2. **to(device)**: a DataLoader without pinned memory, ``images.to(device)`` and the
   normalisation in the loop (the step waits for the copy, which queues behind the
   previous step's work);
3. **prefetcher**: the same loader (pinned) through ``DevicePrefetcher(depth=2)``, the
   normalisation as its transform on the side stream.

Per mode: the mean step time over ``--steps`` timed steps after ``--warmup`` steps (the
device synchronised at both ends), images/s, and how long each step waited for its batch
(the host's wait: for to(device) the loader and the copy; for the prefetcher the loader,
the copy being asynchronous): p50, p99 and share of step time.  The images come from a
pool made before the workers start (no decoding: the loader is never the bottleneck
unless the machine's cores are few), so the differences are the transfer's.  On a CPU
(``--device cpu``) nothing is copied and the run only shows the code works; its numbers
say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from humanfriendly.tables import format_pretty_table
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.read_throughput import markdown
from cube_torch import waits
from cube_torch.prefetch import DevicePrefetcher, normalize, resolve_device
from tools.harness import machine

# ImageNet's channel means and standard deviations in 0-255 units (torchvision's, x 255).
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
CLASSES = 1000
# Distinct images in the pool the dataset cycles through: enough that batches differ, few
# enough to make in a second.
POOL = 64


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18() -> nn.Module:
    """torchvision's ResNet-18 layout (here, so that the benchmark needs no torchvision)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    inputs = 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
        inputs = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


class Images(Dataset[tuple[torch.Tensor, int]]):
    """``uint8`` CHW images from a pool (a fresh copy per sample, as a decoder's would be)."""

    def __init__(self, size: int, samples: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.pool = torch.randint(0, 256, (POOL, 3, size, size), dtype=torch.uint8, generator=generator)
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.pool[i % POOL].clone(), i % CLASSES


@dataclass(frozen=True)
class Row:
    mode: str
    steps: int
    seconds: float
    waits: waits.DataWait


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], device: torch.device, warmup: int, steps: int,
          mode: str, channels_last: bool) -> Row:
    """``warmup`` then ``steps`` timed steps of a fresh model over ``batches``, whose
    ``next()`` time is each step's wait for its batch."""
    torch.manual_seed(0)
    model = resnet18().to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    counter = waits.WaitCounter()
    started = last = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            synchronize(device)
            started = last = time.perf_counter()
        asked = time.perf_counter()
        images, labels = next(batches)
        got = time.perf_counter()
        if step >= warmup:
            counter.add(got - asked, got - last)
            last = got
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    synchronize(device)
    return Row(mode, steps, time.perf_counter() - started, counter.snapshot())


def run(args: argparse.Namespace) -> list[Row]:
    device = resolve_device(args.device)
    channels_last = device.type == "cuda"
    norm = normalize(MEAN, STD, channels_last=channels_last)
    needed = (args.warmup + args.steps) * args.batch
    dataset = Images(args.image, needed)

    def loader(pinned: bool) -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=args.batch, num_workers=args.workers, pin_memory=pinned,
                          drop_last=True, persistent_workers=False)

    rows = []
    # 1. resident: the same device batch every step.
    images, labels = next(iter(loader(False)))
    resident = (norm(images.to(device)), labels.to(device))
    rows.append(train(_repeat(resident), device, args.warmup, args.steps, "resident", channels_last))

    # 2. to(device) in the loop, from pageable memory.
    def moved() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in loader(False):
            yield norm(images.to(device)), labels.to(device)

    rows.append(train(moved(), device, args.warmup, args.steps, "to(device), not pinned", channels_last))

    # 3. the prefetcher: pinned, copied on the side stream, normalised there.
    transform: Callable[[Any], Any] = lambda batch: (norm(batch[0]), batch[1])  # noqa: E731
    prefetcher = DevicePrefetcher(loader(device.type == "cuda"), device, depth=args.depth, transform=transform)
    rows.append(train(iter(prefetcher), device, args.warmup, args.steps, f"DevicePrefetcher(depth={args.depth})",
                      channels_last))
    prefetcher.close()
    return rows


def _repeat(batch: tuple[torch.Tensor, torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield batch


def table(rows: list[Row], batch: int) -> tuple[list[str], list[list[str]]]:
    header = ["feeding", "step ms", "images/s", "x resident", "wait p50 ms", "wait p99 ms", "wait share"]
    floor = rows[0].seconds / rows[0].steps
    body = []
    for r in rows:
        step = r.seconds / r.steps
        body.append([r.mode, f"{1000 * step:.1f}", f"{batch / step:,.0f}", f"{step / floor:.2f}",
                     f"{1000 * r.waits.percentile(50):.2f}", f"{1000 * r.waits.percentile(99):.2f}",
                     f"{100 * r.waits.share:.1f} %"])
    return header, body


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_prefetch",
                                description="ResNet-18 step time fed by DevicePrefetcher, by to(device) from "
                                "pageable memory, and from a resident batch.")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument("--batch", type=int, default=256, help="images per batch (default: 256)")
    p.add_argument("--image", type=int, default=224, help="image side in pixels (default: 224)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per mode (default: 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default: 10)")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers (default: 8)")
    p.add_argument("--depth", type=int, default=2, help="batches the prefetcher stages ahead (default: 2)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args(argv)
    if min(args.batch, args.image, args.steps, args.depth) < 1 or args.warmup < 0 or args.workers < 0:
        p.error("--batch, --image, --steps and --depth must be at least 1, --warmup and --workers at least 0")
    try:
        rows = run(args)
    except ValueError as exc:  # a device this machine has not: one line
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    device = resolve_device(args.device)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit(), **machine(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "load average": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
            "workload": f"ResNet-18 fwd+bwd, batch {args.batch} of uint8 3x{args.image}x{args.image}, "
                        f"{args.workers} workers, {args.steps} steps after {args.warmup}"}
    header, body = table(rows, args.batch)
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    print(markdown(header, body) if args.markdown else format_pretty_table(body, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
