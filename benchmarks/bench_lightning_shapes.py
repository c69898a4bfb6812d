"""The Lightning callback's cost per step shape: launch-bound, balanced, device-bound.

Question:
    How much slower does a ``Trainer.fit`` run with ``BarrierGuard()`` than
    without it, depending on what bounds its step: the host's kernel launches,
    host and device alike, or the device?

Design:
    The three step shapes of ``bench_alternatives.py`` (see there), each run as
    the ``training_step`` of a ``Trainer.fit`` (manual optimization: the shape
    makes its own optimizer step) over ``--steps`` batches, without a logger or
    progress bar. Per shape, one warm-up fit, then ``--rounds`` pairs of fits
    with and without the callback (its defaults: CUDA engine, memory sampling),
    alternating which goes first; each fit is timed from ``on_train_start`` to
    ``on_train_end``, between device syncs. The figure is the median, with its
    IQR, of the pairs' ratios. Whole fits drift on a shared host by more than a
    2% effect, so this resolves the shapes' order, not a 2% target: for that,
    see ``bench_lightning.py``.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_lightning_shapes.py --out benchmarks/results/h200/lightning_shapes.json

    (``bash benchmarks/run_all.sh benchmarks/results/h200`` runs it with the rest
    of the suite.) The committed ``h200/lightning_shapes.json`` is this script's
    own run at 2c45661; ``h200/alternatives.json`` no longer has the ``lightning``
    section these rows had when they were part of ``bench_alternatives.py``.

    CPU smoke run (audit engine; the ratios mean nothing there)::

        PYTHONPATH=src python benchmarks/bench_lightning_shapes.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Step,
    add_shape_args,
    build_shape,
    median,
    quartiles,
    quiet_lightning,
    shape_names,
    sync,
    table,
    write,
)

import barrierguard


def fit_seconds(step: Step, steps: int, device: str, guarded: bool) -> float:
    """One ``Trainer.fit`` whose training step runs ``step``; seconds from train start to end."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Shape(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.anchor = nn.Parameter(torch.zeros(1))
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            step()  # the shape's own forward, backward and optimizer step

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([self.anchor], lr=0.0)

    class Clock(pl.Callback):
        seconds = 0.0
        t0 = 0.0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            sync()
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            sync()
            self.seconds = time.perf_counter() - self.t0

    clock = Clock()
    callbacks: list[Any] = [clock]
    if guarded:
        callbacks.insert(
            0, barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
        )
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_epochs=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
        callbacks=callbacks,
    )
    data = DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)
    trainer.fit(Shape(), data)
    return clock.seconds


def pairs_of_fits(step: Step, args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` pairs of fits with and without the callback, after a warm-up fit."""
    fit_seconds(step, args.steps, args.device, True)
    ratios, bare, guarded = [], [], []
    for i in range(args.rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {g: fit_seconds(step, args.steps, args.device, g) for g in order}
        bare.append(got[False])
        guarded.append(got[True])
        ratios.append(got[True] / got[False])
    return {
        "steps": args.steps,
        "rounds": args.rounds,
        "bare_s": bare,
        "guarded_s": guarded,
        "ratios": ratios,
        "ratio_median": median(ratios),
        "ratio_quartiles": quartiles(ratios),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_shape_args(ap)
    ap.add_argument("--rounds", type=int, default=5, help="pairs of fits per shape")
    ap.add_argument("--steps", type=int, default=100, help="training steps per fit")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    shapes = shape_names(ap, args)
    if args.quick:
        args.rounds, args.steps = 1, 4
    quiet_lightning()
    results: dict[str, Any] = {"command": " ".join(sys.argv), "device": args.device, "shapes": {}}
    rows = []
    for shape in shapes:
        step, config = build_shape(args, shape)
        res = pairs_of_fits(step, args)
        res["config"] = config
        results["shapes"][shape] = res
        q = res["ratio_quartiles"]
        rows.append(
            [
                shape,
                f"{median(res['bare_s']) / args.steps * 1e3:.3f}",
                f"{median(res['guarded_s']) / args.steps * 1e3:.3f}",
                f"{res['ratio_median']:.3f}",
                f"{q[0]:.3f}-{q[1]:.3f}",
            ]
        )
    print("\n## Lightning callback: a fit with BarrierGuard() against the same fit without")
    print(
        table(
            ["shape", "ms per step without", "ms per step with", "ratio (median)", "ratio IQR"],
            rows,
        )
    )
    print(
        f"{args.rounds} pairs of fits of {args.steps} steps per shape, alternating which goes "
        "first; each fit timed from on_train_start to on_train_end"
    )
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
