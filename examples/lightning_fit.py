"""A Lightning fit written the way Lightning's docs teach, and the same fit with the report's fixes.

    barrierguard run examples/lightning_fit.py                   # the default fit: its syncs
    barrierguard run --policy error examples/lightning_fit.py --hinted   # passes: no step sync
    python examples/lightning_fit.py --time                        # ms per step, no barrierguard

The default fit logs its loss with ``self.log(..., prog_bar=True)`` (converted to
a Python number after every batch) and reads batches from a ``DataLoader``
without ``pin_memory`` (a copy from pageable memory, which waits for the device
queue once the batch is large). ``--hinted`` applies what barrierguard's report
says: ``prog_bar=False`` with ``on_step=False, on_epoch=True`` (reduced on the
device, read once per epoch) and ``DataLoader(pin_memory=True)`` (Lightning
already copies with ``non_blocking=True``).

The loader indexes whole batches (a ``BatchSampler`` as the sampler,
``batch_size=None``), as fast input pipelines do: collating 2048 samples one by
one would make the host, not the syncs, set the pace.

``--time`` prints the median time per training step: one synchronize at the
start and one at the end of each timed epoch, never inside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset


class Regressor(pl.LightningModule):
    """An MLP on wide inputs: enough device work per step for a sync to cost."""

    def __init__(self, width: int, depth: int, hinted: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.hinted = hinted

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.hinted:
            self.log("loss", loss, on_step=False, on_epoch=True)
        else:
            self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepTimer(pl.Callback):
    """Median ms per training step over each epoch after the first (two syncs an epoch)."""

    def __init__(self) -> None:
        self.per_step: list[float] = []
        self._t0 = 0.0
        self._n = 0

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._t0, self._n = self._now(), 0

    def on_train_batch_end(self, *args: Any) -> None:
        self._n += 1

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        elapsed = self._now() - self._t0
        if trainer.current_epoch > 0 and self._n:
            self.per_step.append(elapsed / self._n * 1e3)


def main(argv: list[str] | None = None) -> float | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hinted", action="store_true", help="apply the report's fixes")
    p.add_argument("--time", action="store_true", help="print the median ms per step")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches", type=int, default=40, help="training batches per epoch")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    ns = p.parse_args(argv)
    torch.manual_seed(0)
    n = ns.batches * ns.batch
    data = TensorDataset(torch.randn(n, ns.width), torch.randn(n, 1))
    pin = ns.hinted and torch.cuda.is_available()
    # One index per batch: TensorDataset takes the list of indices at once.
    batches = BatchSampler(RandomSampler(data), batch_size=ns.batch, drop_last=True)
    train = DataLoader(data, sampler=batches, batch_size=None, pin_memory=pin)
    val = DataLoader(
        TensorDataset(torch.randn(2 * ns.batch, ns.width), torch.randn(2 * ns.batch, 1)),
        batch_size=ns.batch,
        pin_memory=pin,
    )
    timer = StepTimer()
    trainer = pl.Trainer(
        max_epochs=ns.epochs,
        accelerator="auto",
        devices=1,
        callbacks=[timer] if ns.time else [],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Regressor(ns.width, ns.depth, ns.hinted), train, val)
    if ns.time and timer.per_step:
        median = statistics.median(timer.per_step)
        print(f"ms/step {median:.3f}")
        return median
    return None


if __name__ == "__main__":
    main()
