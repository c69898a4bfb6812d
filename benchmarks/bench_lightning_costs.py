"""Where does the Lightning callback's time go, per training step?

Question:
    Of the time a fit with ``BarrierGuard()`` spends in barrierguard's own code,
    how much goes to each entry point: the handler of each sync, the step hook
    (with the memory sampler and the step timeline), the engine's wrappers?

Design:
    One fit with the callback per model (``--steps`` batches; the first
    ``--skip`` and the last 5 left out) on the models of ``bench_lightning.py``.
    Each entry point is replaced, for the fit, by a timed copy (``POINTS``):

    * ``sync handler``: the sync-debug warning's handler, once per sync; inside
      it ``observe`` (the one walk of the stack: the user's and the framework's
      line, the framework mechanism and the phase), ``hub.emit`` and, inside
      that, the guard's ``record``;
    * ``step hook``: the callback's ``on_train_batch_end`` (the step boundary),
      with the memory sampler and the step timeline inside it;
    * ``wrappers``: the calls per step of each method the engine wraps (counted,
      not timed, in the fit), times the wrapper's cost per call, measured in this
      process on tensors like the fit's (a CPU scalar's ``item()``, a pinned
      batch's ``to("cuda", non_blocking=True)``), wrapped against bare.

    Per call it reports the median (the typical call) and the mean; per step, the
    time summed over the measured steps divided by their number (the memory
    sampler reads its probes every Nth step only, so its median call is the
    bookkeeping of the other steps). The total adds the outermost entries. What
    it cannot see: sync-debug mode's own C++ and ``warnings`` work before the
    handler runs, Lightning calling the hooks, and the caches the callback's code
    evicts from the training loop's; ``bench_lightning.py`` sees those.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_lightning_costs.py \
        --out benchmarks/results/h200/lightning_costs.json | tee benchmarks/results/h200/lightning_costs.txt

    GPU only (it times the CUDA engine), about 30 s. The committed run is at
    2c45661, where ``frameworks.annotate`` inside the guard's ``_record`` names
    the mechanism (the run before timed ``mechanism_of`` in the sync handler).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    lightning_loader,
    lightning_model,
    lightning_settings,
    lightning_trainer,
    quiet_lightning,
    table,
    write,
)

import barrierguard
from barrierguard.detect import cuda as ce
from barrierguard.detect import hub
from barrierguard.detect.patch import Patches
from barrierguard.integrations import lightning_callback as lt
from barrierguard.session import guard as _guard
from barrierguard.session import memory as _memory
from barrierguard.session import timeline as _timeline

# (owner, attribute, label, nested under): every entry point timed in the fit.
POINTS: tuple[tuple[Any, str, str, str], ...] = (
    (ce.CudaEngine, "_show", "sync handler", ""),
    (ce, "observe", "observe (the one walk)", "sync handler"),
    (hub, "emit", "emit", "sync handler"),
    (_guard.Guard, "record", "Guard.record", "emit"),
    (lt.BarrierGuardCallback, "on_train_batch_end", "step hook", ""),
    (_memory.MemoryMonitor, "on_step", "memory sampler", "step hook"),
    (_timeline.StepTimeline, "on_step", "step timeline", "step hook"),
)


class _Timers:
    """Replaces each entry point with a timed one while ``on``; :meth:`undo` restores."""

    def __init__(self) -> None:
        self.on = False
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.calls: collections.Counter[str] = collections.Counter()
        self._patches = Patches()

    def _timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.times[label].append(clock() - t0)

        return timed

    def _counted(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.calls[label] += 1
            return fn(*args, **kwargs)

        return counted

    def install(self) -> None:
        for owner, name, label, _ in POINTS:
            self._patches.set(owner, name, self._timed(getattr(owner, name), label))
        # The wrappers are counted, not timed: counting costs less than a timer.
        patch_calls = ce.CudaEngine._patch_calls
        timers = self

        def counting_patch_calls(engine: ce.CudaEngine) -> None:
            patch_calls(engine)
            for owner, name, _ in list(engine._patches._stack):
                label = f"{getattr(owner, '__name__', owner)}.{name}"
                engine._patches.set(owner, name, timers._counted(getattr(owner, name), label))

        self._patches.set(ce.CudaEngine, "_patch_calls", counting_patch_calls)

    def undo(self) -> None:
        self._patches.undo()


def _wrapper_costs(batch: torch.Tensor) -> dict[str, float]:
    """Seconds a wrapper adds per call, on tensors like the fit's, bare vs wrapped."""
    scalar = torch.tensor(3.0)
    pinned = batch.pin_memory()
    on_gpu = torch.randn(256, 1024, device="cuda")
    cases = {
        "Tensor.item": (lambda: scalar.item(), 20000),
        "Tensor.to": (lambda: pinned.to("cuda", non_blocking=True), 2000),
        "Tensor.to (dtype)": (lambda: on_gpu.to(torch.bfloat16), 2000),
        "torch.tensor": (lambda: torch.tensor(1.0), 20000),
    }

    def per_call() -> dict[str, float]:
        torch.cuda.synchronize()
        return {k: min(timeit.repeat(fn, number=n, repeat=7)) / n for k, (fn, n) in cases.items()}

    bare = per_call()
    engine = ce.CudaEngine()
    engine._patch_calls()
    try:
        wrapped = per_call()
    finally:
        engine._patches.undo()
    return {k: max(0.0, wrapped[k] - bare[k]) for k in cases}


def _fit(args: argparse.Namespace, timers: _Timers) -> tuple[float, int]:
    """One fit with the callback; times steps ``skip`` to ``steps - 5``."""
    import lightning.pytorch as pl

    marks: dict[str, float] = {}
    first, last = args.skip, args.steps - 5

    class Window(pl.Callback):
        n = 0

        def on_train_batch_start(self, *a: Any) -> None:
            if self.n == first:
                timers.on = True
                marks["t0"] = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            self.n += 1
            if self.n == last:
                timers.on = False
                marks["t1"] = time.perf_counter()

    guard = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
    trainer = lightning_trainer([guard, Window()])
    torch.manual_seed(0)
    trainer.fit(lightning_model(args), lightning_loader(args))
    steps = last - first
    return (marks["t1"] - marks["t0"]) / steps, steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", choices=("mlp", "transformer"), nargs="+", default=["mlp", "transformer"]
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=20, help="steps left out at the start")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lightning_costs.py times the CUDA engine's code: it needs a GPU")
    quiet_lightning()
    results: dict[str, Any] = {}
    for model in args.model:
        margs = lightning_settings(model, args.steps)
        margs.skip = args.skip
        timers = _Timers()
        timers.install()
        try:
            step_s, steps = _fit(margs, timers)
        finally:
            timers.undo()
        # One batch of the fit's loader: the tensor Lightning copies to the GPU.
        per_call = _wrapper_costs(next(iter(lightning_loader(margs)))[0])
        rows: list[list[object]] = []
        record: dict[str, dict[str, Any]] = {}
        for _, _, label, parent in POINTS:
            xs = timers.times.get(label, [])
            if not xs:
                continue
            med = statistics.median(xs)
            # The mean, not the median: the memory sampler's work comes every Nth step.
            per_step = sum(xs) / steps
            record[label] = {
                "calls_per_step": len(xs) / steps,
                "median_us": med * 1e6,
                "mean_us": statistics.fmean(xs) * 1e6,
                "per_step_us": per_step * 1e6,
                "inside": parent,
            }
            name = f"  {label} (in {parent})" if parent else label
            rows.append(
                [
                    name,
                    f"{len(xs) / steps:.2f}",
                    f"{med * 1e6:.1f}",
                    f"{statistics.fmean(xs) * 1e6:.1f}",
                    f"{per_step * 1e6:.1f}",
                ]
            )
        wrappers = 0.0
        for label, n in sorted(timers.calls.items()):
            cost = per_call.get(label)
            if cost is None:
                cost = per_call["Tensor.to (dtype)"] if label.startswith("Tensor.") else 0.0
            calls = n / steps
            wrappers += calls * cost
            record[f"wrapper {label}"] = {
                "calls_per_step": calls,
                "median_us": cost * 1e6,
                "per_step_us": calls * cost * 1e6,
            }
            rows.append(
                [
                    f"wrapper {label}",
                    f"{calls:.2f}",
                    f"{cost * 1e6:.2f}",
                    "",
                    f"{calls * cost * 1e6:.1f}",
                ]
            )
        total = sum(v["per_step_us"] for k, v in record.items() if not v.get("inside")) * 1e-6
        rows.append(["**total, outermost entries**", "", "", "", f"**{total * 1e6:.1f}**"])
        print(
            f"{model}: step {step_s * 1e6:.0f} us over {steps} steps; "
            f"callback's own code {total * 1e6:.0f} us/step = {total / step_s:.2%}"
        )
        print(
            table(["entry point", "calls/step", "median us/call", "mean us/call", "us/step"], rows)
        )
        results[model] = {
            "step_us": step_s * 1e6,
            "steps": steps,
            "points": record,
            "total_us": total * 1e6,
            "share": total / step_s,
        }
    write(
        args.out,
        {"benchmark": "lightning_callback_costs", "settings": vars(args), "models": results},
    )


if __name__ == "__main__":
    main()
