"""The PyTorch Lightning case of tests/framework_training.py (see there).  A module of its
own: ``ddp_spawn`` pickles the LightningModule into its ranks, so the class must be
importable, and importing Lightning costs seconds the other cases need not pay."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from tests.framework_training import SEED, Recorder, loss_of, make_loader, tiny_model


class Module(pl.LightningModule):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        self.model = tiny_model()
        self.recorder: Recorder | None = None

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        # With ddp_spawn Lightning puts a DistributedSampler in it.  A spawned rank would start
        # its workers by spawn too, each importing torch anew (8 s apiece on two loaded
        # cores); they only read files, so fork them: the ranks themselves are spawned.
        return make_loader(self.spec, "fork" if self.trainer.world_size > 1 else None)

    def on_fit_start(self) -> None:
        self.recorder = Recorder(self.spec, self.global_rank, self.trainer.world_size)

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        assert self.recorder is not None
        self.recorder.batch(self.current_epoch, batch)
        return loss_of(self.model, batch)

    def on_train_epoch_end(self) -> None:
        assert self.recorder is not None
        self.recorder.epoch_end(self.current_epoch)

    def on_train_end(self) -> None:
        assert self.recorder is not None
        self.recorder.finish(self.trainer.strategy.barrier)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(spec: dict[str, Any], devices: int, strategy: str) -> None:
    pl.seed_everything(SEED)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=spec["epochs"],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Module(spec))
