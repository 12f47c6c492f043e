"""Training scripts for tests/torch/test_frameworks.py: each framework's own way of
training a tiny model over a folder of small files, written as a user would write it.

Run as ``python -m tests.framework_training CASE SPEC`` (or under torchrun): frameworks
start processes and set up process groups, which the pytest process must not host.
SPEC is a JSON object::

    {"root": folder of the files, "names": [file names under root], "out": folder, "epochs": 2,
     "mount": the mount point and "baseline": the daemon's request count before the run
     (with cube_torch)}

Without ``FRAMEWORK_TEST_CUBE_TORCH=1`` in the environment the run never imports
cube_torch (the reference); with it, the script imports cube_torch at its top, as a user
would (``VOL_NAME`` comes from the environment), and spawned or forked ranks import this
module, and with it cube_torch, too.

Every rank writes ``OUT/rank<R>.json``: what it read in each epoch (``[index, crc32,
size]`` per sample, in the order the loader handed them out) and, with cube_torch, its
job name, its daemon counters after every epoch (once the daemon has counted every open
of the epoch), ``cube_torch.stats()`` at the end and, from rank 0 while every rank is
still alive, ``cubefs-fuse status`` (JSON and table).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import tests.torchvision_shim  # noqa: F401  (torchmetrics, imported by Lightning, imports torchvision)

CUBE_TORCH = os.environ.get("FRAMEWORK_TEST_CUBE_TORCH") == "1"
if CUBE_TORCH:
    import cube_torch  # noqa: F401  (the two lines a user adds; VOL_NAME is in the environment)

SEED = 1234
BATCH = 4  # samples per batch and rank
WORKERS = 2  # DataLoader workers per rank
# How long a rank waits for the daemon to count an epoch's opens (it counts an open at
# its release, which the kernel sends asynchronously after close()).
COUNT_TIMEOUT = 60.0


class Files(Dataset[torch.Tensor]):
    """Sample i: [i, crc32 of file i's bytes, its size]; the paths are its train_data_list()."""

    def __init__(self, root: str, names: list[str]) -> None:
        self.paths = [os.path.join(root, name) for name in names]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.paths[i], "rb") as f:
            data = f.read()
        return torch.tensor([i, zlib.crc32(data), len(data)], dtype=torch.int64)

    def train_data_list(self) -> np.ndarray:
        return np.array(self.paths)


def tiny_model() -> torch.nn.Module:
    return torch.nn.Linear(1, 1)


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    x = batch[:, 2:3].float() / 10_000.0  # the file size, scaled
    y = (batch[:, 1:2] % 7).float()  # a target derived from the bytes
    return torch.nn.functional.mse_loss(model(x), y)


class Recorder:
    """One rank's record of the run, written to OUT/rank<R>.json by :meth:`finish`."""

    def __init__(self, spec: dict[str, Any], rank: int, world: int) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.epochs: list[list[list[int]]] = [[] for _ in range(spec["epochs"])]
        self.counters: list[dict[str, Any]] = []

    def batch(self, epoch: int, batch: torch.Tensor) -> None:
        self.epochs[epoch].extend(batch.tolist())

    def epoch_end(self, epoch: int) -> None:
        """With cube_torch: wait until the daemon has counted every open of this epoch, by
        every rank (the run's ranks are the mount's only readers: its total count reaches
        ``baseline`` + one open per sample and epoch), then keep this rank's counters."""
        if not CUBE_TORCH:
            return
        from cubefs_fuse.control.protocol import ControlClient, read_volume_config

        daemon = ControlClient(read_volume_config(os.environ["VOL_NAME"]).control_socket, timeout=10)
        target = self.spec["baseline"] + (epoch + 1) * len(self.spec["names"])
        deadline = time.monotonic() + COUNT_TIMEOUT
        while True:
            current = cube_torch.stats()
            if current is not None and daemon.status()["hits"]["requests"] >= target:
                self.counters.append(current["cumulative"])
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {self.rank}: the daemon did not count {target} opens: {current}")
            time.sleep(0.05)

    def finish(self, barrier: Callable[[], None]) -> None:
        result: dict[str, Any] = {"rank": self.rank, "world": self.world, "pid": os.getpid(),
                                  "host": socket.gethostname(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                                  "epochs": self.epochs, "counters": self.counters}
        if CUBE_TORCH:
            from cube_torch.client import default_job

            result["job"] = default_job()
            result["stats"] = cube_torch.stats()
            barrier()  # every rank has planned and counted its last epoch
            if self.rank == 0:
                result["status"] = _cli("status", self.spec["mount"], "--json")
                result["status_table"] = _cli("status", self.spec["mount"])
            barrier()  # the other ranks (the job's processes) stay alive until rank 0 has asked
        Path(self.spec["out"], f"rank{self.rank}.json").write_text(json.dumps(result))


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "cubefs_fuse", *args], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout


def make_loader(spec: dict[str, Any], multiprocessing_context: str | None = None) -> DataLoader[torch.Tensor]:
    # persistent_workers: Lightning asks for it when workers start by spawn (ddp_spawn ranks).
    return DataLoader(Files(spec["root"], spec["names"]), batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                      persistent_workers=True, multiprocessing_context=multiprocessing_context)


# -- Hugging Face Accelerate --------------------------------------------------------------


def accelerate_training(spec: dict[str, Any]) -> None:
    """Accelerate's documented loop: everything through ``Accelerator.prepare``."""
    from accelerate import Accelerator  # type: ignore[import-untyped]
    from accelerate.utils import set_seed  # type: ignore[import-untyped]

    accelerator = Accelerator(cpu=True)
    set_seed(SEED)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(spec))
    recorder = Recorder(spec, accelerator.process_index, accelerator.num_processes)
    for epoch in range(spec["epochs"]):
        for batch in loader:
            recorder.batch(epoch, batch)
            optimizer.zero_grad()
            accelerator.backward(loss_of(model, batch))
            optimizer.step()
        recorder.epoch_end(epoch)
    recorder.finish(accelerator.wait_for_everyone)


def accelerate_notebook(spec: dict[str, Any], processes: int) -> None:
    from accelerate import notebook_launcher

    from tools.harness import free_port

    notebook_launcher(accelerate_training, args=(spec,), num_processes=processes, use_port=str(free_port()))


# -- DeepSpeed ----------------------------------------------------------------------------


def deepspeed_training(spec: dict[str, Any]) -> None:
    """``deepspeed.initialize(training_data=...)``: DeepSpeed builds the loader (its own
    DeepSpeedDataLoader over a DistributedSampler); run under torchrun."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # type: ignore[import-untyped]
    import deepspeed.comm.torch  # type: ignore[import-untyped]

    # DeepSpeed compiles a shared-memory all-reduce for CPU ranks on first use (80 s of
    # g++ on a fresh machine); it speeds up gradients, not data loading: gloo does instead.
    deepspeed.comm.torch.build_shm_op = lambda: None
    torch.manual_seed(SEED)
    model = tiny_model()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"train_batch_size": BATCH * world, "train_micro_batch_size_per_gpu": BATCH,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=Files(spec["root"], spec["names"]), config=config)
    recorder = Recorder(spec, engine.global_rank, engine.world_size)
    for epoch in range(spec["epochs"]):
        loader.data_sampler.set_epoch(epoch)
        for batch in loader:
            recorder.batch(epoch, batch)
            engine.backward(loss_of(engine, batch))
            engine.step()
        recorder.epoch_end(epoch)
    recorder.finish(deepspeed.comm.barrier)


def lightning(spec: dict[str, Any], devices: int, strategy: str) -> None:
    from tests import framework_lightning  # its module imports Lightning: only for these cases

    framework_lightning.fit(spec, devices, strategy)


CASES: dict[str, Callable[[dict[str, Any]], None]] = {
    "lightning": lambda spec: lightning(spec, 1, "auto"),
    "lightning_ddp_spawn": lambda spec: lightning(spec, 2, "ddp_spawn"),
    "accelerate": accelerate_training,
    "accelerate_notebook_launcher": lambda spec: accelerate_notebook(spec, 2),
    "deepspeed_torchrun": deepspeed_training,
}


if __name__ == "__main__":
    CASES[sys.argv[1]](json.loads(sys.argv[2]))
