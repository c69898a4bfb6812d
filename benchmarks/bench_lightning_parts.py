"""Where the Lightning callback's overhead goes: parts switched on and off inside one fit.

A diagnostic, not a target. Whole fits on a shared host drift by 20-40% within
seconds, far more than the parts being measured; adjacent steps of one fit do
not. So each fit here switches one part on at a batch end and off at the next,
and compares each step with the part on to its neighbour with it off (the
switch itself happens between the two timestamps, untimed). Parts:

* ``null``: the switch does nothing (the harness; should give 1.000);
* ``hooks``: a ``BarrierGuard`` callback that never starts, added to and removed
  from the trainer's callbacks (the cost of Lightning calling its hooks);
* ``mode``: CUDA sync-debug mode in warn mode, its warnings ignored;
* ``patches``: the CUDA engine's wrappers on ``Tensor``/``torch`` methods only;
* ``engine``: the whole CUDA engine (mode, wrappers, the warning handler that
  locates each sync), with no guard attached;
* ``engine-noshow``: the engine, its warning handler replaced by a no-op;
* ``engine-nopatch``: the engine without its wrappers.

Caveat: switching a part that patches ``torch.Tensor`` changes the type at every
step, which a fit with the callback does once; Python re-specializes the call
sites after each change, in on- and off-steps alike, so the ratio keeps the
wrapper's own cost but the absolute step times do not.

GPU only (the parts are the CUDA engine's):
    PYTHONPATH=src python benchmarks/bench_lightning_parts.py --out benchmarks/results/h200/lightning_parts.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lightning as bl
from _common import sync, table, write

import barrierguard
from barrierguard._engines import cuda as ce

PARTS = ("null", "hooks", "mode", "patches", "engine", "engine-noshow", "engine-nopatch")


def _switch(part: str, holder: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
    """(on, off) for ``part``; ``holder["trainer"]`` is set once the trainer exists."""
    if part == "null":
        return (lambda: None), (lambda: None)
    if part == "hooks":
        cb = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)

        def add() -> None:
            # A new list: Lightning is iterating the old one right now.
            holder["trainer"].callbacks = [cb, *holder["trainer"].callbacks]

        def remove() -> None:
            holder["trainer"].callbacks = [c for c in holder["trainer"].callbacks if c is not cb]

        return add, remove
    if part == "mode":

        def mode_on() -> None:
            warnings.filterwarnings("ignore", message=ce.SYNC_MESSAGE)
            warnings.filterwarnings("ignore", message=ce._PROTOTYPE_MESSAGE)
            torch.cuda.set_sync_debug_mode("warn")

        def mode_off() -> None:
            torch.cuda.set_sync_debug_mode(0)
            del warnings.filters[:2]
            warnings._filters_mutated()  # type: ignore[attr-defined]

        return mode_on, mode_off
    engine = ce.CudaEngine()
    if part == "patches":
        return engine._patch_calls, engine._patches.undo
    if part == "engine":
        return engine.install, engine.uninstall
    if part == "engine-noshow":

        def quiet_on() -> None:
            engine.install()
            setattr(warnings, engine._show_attr, lambda *a: None)

        def quiet_off() -> None:
            setattr(warnings, engine._show_attr, engine._show)
            engine.uninstall()

        return quiet_on, quiet_off
    if part == "engine-nopatch":

        def bare_on() -> None:
            engine.install()
            engine._patches.undo()

        return bare_on, engine.uninstall
    raise ValueError(f"unknown part {part!r}; expected one of {', '.join(PARTS)}")


class _Toggler:
    """A callback that switches a part at every batch end and times each step."""

    def __new__(cls, on: Callable[[], None], off: Callable[[], None]) -> Any:
        import lightning.pytorch as pl

        class Toggler(pl.Callback):
            def __init__(self) -> None:
                self.state = False
                self.steps: list[tuple[bool, float]] = []
                self._t = 0.0

            def on_train_start(self, *args: Any) -> None:
                sync()
                self._t = time.perf_counter()

            def on_train_batch_end(self, *args: Any) -> None:
                now = time.perf_counter()
                self.steps.append((self.state, now - self._t))
                (off if self.state else on)()
                self.state = not self.state
                self._t = time.perf_counter()

            def on_train_end(self, *args: Any) -> None:
                if self.state:
                    off()
                    self.state = False

        return Toggler()


def _fit(args: argparse.Namespace, loader: Any, part: str) -> dict[str, float]:
    gc.collect()
    holder: dict[str, Any] = {}
    on, off = _switch(part, holder)
    toggler = _Toggler(on, off)
    trainer = bl._trainer([toggler])
    holder["trainer"] = trainer
    torch.manual_seed(0)
    trainer.fit(bl._module(args), loader)
    steps = toggler.steps
    # Each on-step against the off-step next to it (the first step of the fit is left out).
    pairs = [
        steps[i][1] / steps[i - 1][1] if steps[i][0] else steps[i - 1][1] / steps[i][1]
        for i in range(1, len(steps), 2)
    ]
    on_steps = [d for s, d in steps if s]
    off_steps = [d for s, d in steps if not s]
    return {
        "on_us": statistics.median(on_steps) * 1e6,
        "off_us": statistics.median(off_steps) * 1e6,
        "paired": statistics.median(pairs),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fits", type=int, default=3, help="fits per part")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lightning_parts.py measures the CUDA engine: it needs a GPU")
    args.model = "mlp"
    vars(args).update(bl.MODEL_DEFAULTS["mlp"])
    bl._quiet()
    loader = bl._loader(args)
    _fit(args, loader, "null")  # warm-up
    results: dict[str, list[dict[str, float]]] = {p: [] for p in args.parts}
    for _ in range(args.fits):
        for part in args.parts:
            results[part].append(_fit(args, loader, part))
    rows = []
    for part, fits in results.items():
        rows.append(
            [
                part,
                f"{statistics.median(f['off_us'] for f in fits):.0f}",
                f"{statistics.median(f['on_us'] for f in fits):.0f}",
                " ".join(f"{f['paired']:.4f}" for f in fits),
                f"**{statistics.median(f['paired'] for f in fits):.4f}**",
            ]
        )
    print(
        table(
            [
                "part",
                "step off (us)",
                "step on (us)",
                "on / off, adjacent steps, per fit",
                "median",
            ],
            rows,
        )
    )
    write(
        args.out,
        {"benchmark": "lightning_callback_parts", "settings": vars(args), "parts": results},
    )


if __name__ == "__main__":
    main()
