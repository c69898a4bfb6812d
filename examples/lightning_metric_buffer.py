"""A LightningModule that logs its training metrics through ``MetricBuffer``.

    python examples/lightning_metric_buffer.py                      # CUDA when available
    python examples/lightning_metric_buffer.py --logging self_log   # the same with self.log

``self.log(name, value, on_step=False, on_epoch=True)`` does not synchronize:
Lightning keeps a running sum on the device and reduces it at the end of the
epoch. What it costs is host time, some Python and a few small kernels per
call and per step (docs/metrics.md has the measured rows). A ``MetricBuffer``
updated in ``training_step`` keeps the same reductions on the device for a
fraction of that host time (for a set of names it has seen before, ``update``
only queues references), and ``on_train_epoch_end`` reads every value back
with one transfer and hands them to Lightning as host tensors.

Both ways print the same numbers: ``--logging self_log`` runs the same module
with ``self.log``. Values logged per step for a progress bar (``on_step=True``,
``prog_bar=True``) are another matter: Lightning converts them with
``.item()`` every step.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import barrierguard

# The reductions MetricBuffer keeps, and what self.log(reduce_fx=...) does alike.
SPECS: dict[str, Any] = {
    "train/loss": ("mean", "weighted"),  # weighted by the batch size, like self.log's mean
    "train/acc": ("mean", "weighted"),
    "train/loss_max": "max",
}
REDUCE_FX = {"train/loss": "mean", "train/acc": "mean", "train/loss_max": "max"}


class Classifier(pl.LightningModule):
    """A small classifier that logs loss, accuracy and the largest loss of each epoch."""

    def __init__(self, width: int = 32, classes: int = 4, logging: str = "buffer") -> None:
        super().__init__()
        if logging not in ("buffer", "self_log"):
            raise ValueError(
                f"Classifier(logging={logging!r}) is not a valid logging: "
                f"expected 'buffer' or 'self_log'"
            )
        self.logging = logging
        self.net = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, classes))
        # Declared up front: under DDP every rank must register the same names, and
        # compute() reduces them across ranks with one collective.
        self.train_metrics = barrierguard.MetricBuffer(SPECS, default=None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        values = {"train/loss": loss, "train/acc": acc, "train/loss_max": loss}
        if self.logging == "buffer":
            self.train_metrics.update(values, n=x.shape[0])  # no sync, no kernel launch
        else:
            for name, value in values.items():
                self.log(name, value, on_step=False, on_epoch=True, reduce_fx=REDUCE_FX[name])
        return loss

    def on_train_epoch_end(self) -> None:
        if self.logging != "buffer":
            return
        results = self.train_metrics.compute()  # the epoch's one device-to-host transfer
        self.train_metrics.reset()
        # Host tensors stay on the host; a Python float would be copied to the device
        # (one blocking copy per value). MetricBuffer has already reduced across ranks.
        self.log_dict({name: torch.tensor(value) for name, value in results.items()})

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint taken mid-epoch resumes the running values (cloned on the device).
        checkpoint["train_metrics"] = self.train_metrics.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "train_metrics" in checkpoint:
            self.train_metrics.load_state_dict(checkpoint["train_metrics"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(steps: int, batch: int, width: int, classes: int) -> DataLoader[Any]:
    """``steps`` batches of random data; the last one is short (weights matter)."""
    g = torch.Generator().manual_seed(0)
    n = steps * batch - batch // 2
    data = TensorDataset(
        torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g)
    )
    return DataLoader(data, batch_size=batch, pin_memory=torch.cuda.is_available())


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--logging", choices=("buffer", "self_log"), default="buffer")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50, help="batches per epoch")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Classifier(args.width, logging=args.logging)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_epochs=args.epochs,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(model, loader(args.steps, args.batch, args.width, 4))
    results = {name: float(value) for name, value in sorted(trainer.callback_metrics.items())}
    print(f"last epoch ({args.logging}): " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
    return results


if __name__ == "__main__":
    main()
