"""A small LightningModule and a fit helper for the callback tests (also run in spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class TinyModule(pl.LightningModule):
    """A linear regression that logs like a typical module, with one sync of its own."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)
        if batch_idx == 0:
            self.first_loss = loss.item()  # the user's own sync, once per epoch
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loaders(
    width: int = 8, n: int = 64, batch: int = 16, pin_memory: bool = False
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g))
    return (
        DataLoader(data, batch_size=batch, pin_memory=pin_memory),
        DataLoader(data, batch_size=2 * batch, pin_memory=pin_memory),
    )


def trainer(root: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    from lightning.pytorch.loggers import CSVLogger

    options: dict[str, Any] = {
        "max_epochs": 2,
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "logger": CSVLogger(str(root), name="logs"),
        "log_every_n_steps": 2,
        "deterministic": True,
        "default_root_dir": str(root),
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def fit(root: Path, callbacks: list[pl.Callback], **kwargs: Any) -> TinyModule:
    pl.seed_everything(0, verbose=False)
    model = TinyModule()
    train, val = loaders()
    trainer(root, callbacks, **kwargs).fit(model, train, val)
    return model
