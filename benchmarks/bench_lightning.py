"""Overhead of the Lightning callback: a fit with ``BarrierGuard()`` against one without.

Paired, interleaved fits: each round runs one fit without the callback and one
with it (order alternating), timing the training loop only (``on_train_start``
to ``on_train_end``, between two device synchronizations); the ratio is taken
within the round and the median over rounds is reported, with its IQR. Every
fit starts after a ``gc.collect()``. A second column gives the same ratio for
each fit's median step (host time between two batch ends), which a stray slow
step (a page fault, another tenant) does not move; the target is judged on the
first, whole-loop column, which also holds the callback's periodic work.

The model is a realistic small one: a 4-block MLP (width 1024) on 4096-wide
inputs, AdamW, ``self.log(prog_bar=True)`` of the loss, a pinned DataLoader,
bf16 autocast on the GPU. The callback runs with its defaults (CUDA engine
on a GPU, memory sampling on).

GPU (the target: ratio at most 1.02):
    PYTHONPATH=src python benchmarks/bench_lightning.py --out benchmarks/results/lightning_h200.json
CPU smoke test (tiny settings, audit engine):
    PYTHONPATH=src python benchmarks/bench_lightning.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, sync, table, write

import barrierguard


def _module(width: int, hidden: int, blocks: int) -> Any:
    import lightning.pytorch as pl

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = [nn.Linear(width, hidden), nn.GELU()]
            for _ in range(blocks - 1):
                layers += [nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU()]
            layers.append(nn.Linear(hidden, 10))
            self.net = nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return MLP()


class _Clock:
    """A callback that times the training loop between two device syncs."""

    def __new__(cls) -> Any:
        import lightning.pytorch as pl

        class Clock(pl.Callback):
            seconds = 0.0
            _t0 = 0.0

            def __init__(self) -> None:
                self.stamps: list[float] = []

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                sync()
                self._t0 = time.perf_counter()
                self.stamps.append(self._t0)

            def on_train_batch_end(self, *args: Any) -> None:
                self.stamps.append(time.perf_counter())

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                sync()
                self.seconds = time.perf_counter() - self._t0

            def median_step(self) -> float:
                """Median host time between batch ends (robust to a stray slow step)."""
                return median([b - a for a, b in itertools.pairwise(self.stamps)])

        return Clock()


def _fit(
    args: argparse.Namespace, loader: DataLoader[Any], guarded: bool
) -> tuple[float, int, float]:
    """One fit: (training-loop seconds, syncs found, median step seconds)."""
    import lightning.pytorch as pl

    gc.collect()  # each fit starts from the same heap, not from the last one's garbage
    clock = _Clock()
    callbacks: list[Any] = [clock]
    guard = None
    if guarded:
        guard = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
        callbacks.insert(0, guard)
    gpu = torch.cuda.is_available()
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_epochs=1,
        precision="bf16-mixed" if gpu else "32-true",
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
        callbacks=callbacks,
    )
    torch.manual_seed(0)
    trainer.fit(_module(args.width, args.hidden, args.blocks), loader)
    syncs = guard.report.total_syncs if guard is not None else 0
    return clock.seconds, syncs, clock.median_step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=300, help="training batches per fit")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test settings")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.tiny:
        args.rounds, args.steps, args.batch = 3, 20, 32
        args.width, args.hidden, args.blocks = 64, 64, 2
    warnings.filterwarnings("ignore", module="lightning")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch
    data = TensorDataset(
        torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    loader = DataLoader(
        data, batch_size=args.batch, pin_memory=torch.cuda.is_available(), drop_last=True
    )
    _fit(args, loader, False)  # warm-up: CUDA context, cuBLAS, allocator, imports
    _fit(args, loader, True)
    bare: list[float] = []
    guarded: list[float] = []
    ratios: list[float] = []
    step_ratios: list[float] = []
    syncs = 0
    for i in range(args.rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        times: dict[bool, float] = {}
        steps: dict[bool, float] = {}
        for flag in order:
            times[flag], n_syncs, steps[flag] = _fit(args, loader, flag)
            if flag:
                syncs = n_syncs
        bare.append(times[False])
        guarded.append(times[True])
        ratios.append(times[True] / times[False])
        step_ratios.append(steps[True] / steps[False])
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    qs = statistics.quantiles(step_ratios, n=4) if len(step_ratios) > 1 else [step_ratios[0]] * 3
    step_us = median(bare) / args.steps * 1e6
    rows = [
        [
            f"MLP {args.blocks}x{args.hidden}, in {args.width}, batch {args.batch}",
            f"{args.steps}",
            f"{median(bare) * 1e3:.1f} ms ({step_us:.0f} us/step)",
            f"{median(guarded) * 1e3:.1f} ms",
            f"**{median(ratios):.4f}** ({q[0]:.4f}-{q[2]:.4f})",
            f"{median(step_ratios):.4f} ({qs[0]:.4f}-{qs[2]:.4f})",
            f"{syncs}",
        ]
    ]
    print(
        table(
            [
                "model",
                "steps",
                "fit without",
                "fit with BarrierGuard",
                "with / without (IQR)",
                "median step, with / without (IQR)",
                "syncs found",
            ],
            rows,
        )
    )
    write(
        args.out,
        {
            "benchmark": "lightning_callback_overhead",
            "settings": vars(args),
            "bare_s": bare,
            "guarded_s": guarded,
            "ratios": ratios,
            "median_ratio": median(ratios),
            "iqr": [q[0], q[2]],
            "step_ratios": step_ratios,
            "median_step_ratio": median(step_ratios),
            "step_iqr": [qs[0], qs[2]],
            "syncs_found": syncs,
            "target": 1.02,
        },
    )


if __name__ == "__main__":
    main()
