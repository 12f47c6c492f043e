"""The demo's training job: a tiny CNN trained on CPU over ``ImageFolder`` on the mount.

An ordinary PyTorch training script plus the two lines cube_torch asks of its users::

    import cube_torch                      # patches DataLoader (at import)
    os.environ["VOL_NAME"] = "<volName>"   # read at each epoch start

``python -m demo`` calls :func:`train` with a callback that reads the daemon's counters
at each epoch end; it also runs alone against any mounted ai_prefetch volume::

    python -m demo.train MOUNTPOINT --vol-name VOLNAME [--epochs 3 --workers 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import cube_torch
from tools import torchvision_shim

torchvision_shim.install()  # before the first torchvision import (see its docstring)
from torchvision import datasets, transforms  # type: ignore[import-untyped]  # noqa: E402

# RandomResizedCrop keeps 50-100 % of each image's area: augmentation as in ImageNet
# training (which uses 8-100 %), milder so that a 3-epoch run visibly learns.
CROP_SCALE = (0.5, 1.0)
# ToTensor gives [0, 1]; centre on 0.5 with a spread of 0.25, about the data's.
NORMALIZE_MEAN = [0.5, 0.5, 0.5]
NORMALIZE_STD = [0.25, 0.25, 0.25]
# Adam's learning rate: large enough for a tiny net to learn in ~40 steps, still stable.
LEARNING_RATE = 3e-3


@dataclass(frozen=True)
class EpochResult:
    epoch: int
    samples: int
    seconds: float  # wall time of the epoch, worker start-up included
    loss: float  # mean training loss over the epoch
    accuracy: float  # fraction of training samples classified right (before each step)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


def tiny_cnn(classes: int) -> nn.Module:
    """Three strided 3x3 convolutions, global average pooling, one linear layer (~25 k weights)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes),
    )


def train(data_dir: Path, *, epochs: int = 3, workers: int = 2, batch_size: int = 32, image_size: int = 64,
          seed: int = 0, batch_timeout: float = 120.0, torch_threads: int = 1,
          on_epoch_end: Callable[[EpochResult], None] | None = None) -> list[EpochResult]:
    """Train for ``epochs``; ``batch_timeout``: seconds a batch may take before failing.

    ``torch_threads``: intra-op threads of this process.  The tiny model gains nothing
    from more, and on a small machine they would take cores from the DataLoader workers.
    """
    torch.set_num_threads(torch_threads)
    torch.manual_seed(seed)
    dataset = datasets.ImageFolder(str(data_dir), transform=transforms.Compose([
        transforms.RandomResizedCrop(image_size, scale=CROP_SCALE),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(NORMALIZE_MEAN, NORMALIZE_STD),
    ]))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(seed), timeout=batch_timeout)
    model = tiny_cnn(len(dataset.classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    results: list[EpochResult] = []
    for epoch in range(epochs):
        started = time.perf_counter()
        samples = correct = 0
        loss_sum = 0.0
        for images, labels in loader:
            optimizer.zero_grad()
            logits = model(images)
            loss = nn.functional.cross_entropy(logits, labels)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            samples += len(labels)
            loss_sum += loss.item() * len(labels)
            correct += int((logits.argmax(1) == labels).sum())
        result = EpochResult(epoch, samples, time.perf_counter() - started, loss_sum / samples, correct / samples)
        print(f"epoch {epoch}: {samples} samples in {result.seconds:.2f} s = {result.samples_per_s:,.0f} samples/s, "
              f"loss {result.loss:.3f}, accuracy {result.accuracy:.0%}", flush=True)
        results.append(result)
        if on_epoch_end is not None:
            on_epoch_end(result)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.train", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("data", type=Path, help="an ImageFolder tree (class folders) on a cubefs-fuse mount")
    p.add_argument("--vol-name", required=True, help="the mount's volName (becomes VOL_NAME)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    os.environ["VOL_NAME"] = args.vol_name
    train(args.data, epochs=args.epochs, workers=args.workers, batch_size=args.batch_size)
    cube_torch.report_once()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
