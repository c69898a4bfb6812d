"""What does ``watch()`` cost: per training step when nothing syncs, and per sync it records?

Question:
    How much slower does a training step run under ``watch()``, on the step where
    its cost shows most (launch-bound, no sync in it), and how much does it add to
    each sync it records?

Design:
    * Per step: an Adam step of an MLP (width 512, batch 64, its layer count
      calibrated to a 1 ms bare step) whose host launches kernels as fast as it
      can. Variants ``bare``, ``watch()``, ``watch(memory=False)`` and, on a GPU,
      sync-debug mode alone (its warnings ignored) time blocks of ``--steps``
      steps in ``--pairs`` paired rounds (every variant once per round, the order
      rotating); the figure is the median of the per-round ratios to bare, with
      its IQR. Each guard is started before its block and stopped after it; its
      one-time ``start()+stop()`` is timed apart.
    * Per sync (GPU only): a loop of ``--calls`` ``.item()`` on an idle GPU,
      ``--repeats`` times, bare, under ``watch()`` and under sync-debug mode with
      a naive ``traceback.extract_stack(limit=12)`` hook; the median microseconds
      per call, and what each adds to the bare call.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_core.py --out benchmarks/results/h200/core.json

    (``bash benchmarks/run_all.sh benchmarks/results/h200`` runs it with the rest
    of the suite and keeps the printed tables in ``core.txt``.) The committed
    ``h200/core.json`` is a run at 2c45661, after the pageable-copy question
    moved to ``bench_pageable.py``: it has no ``pageable_nonblocking`` section.

    CPU smoke run (the per-step rounds only, audit engine)::

        PYTHONPATH=src python benchmarks/bench_core.py --device cpu --layers 1 --pairs 4
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    NaiveSyncDebug,
    adam_mlp_layers,
    adam_mlp_step,
    median,
    paired_rounds,
    paired_summary,
    table,
    timed,
    write,
)

import barrierguard


class _ModeOnly:
    """Sync-debug warn mode with its warnings ignored, and nothing else."""

    def __enter__(self) -> None:
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("ignore", message="called a synchronizing CUDA operation")
        warnings.filterwarnings("ignore", message="Synchronization debug mode")
        torch.cuda.set_sync_debug_mode("warn")

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(0)
        self._w.__exit__(None, None, None)


def overhead(device: str, steps: int, pairs: int, layers: int, width: int) -> dict[str, Any]:
    step = adam_mlp_step(device, layers, width)

    def block() -> None:
        for _ in range(steps):
            step()

    # Each guard is started before its timed block and stopped after it: the
    # per-step cost, not the one-time start/stop (measured apart below).
    guards = {
        "watch": barrierguard.watch(policy="record"),
        "watch_no_memory": barrierguard.watch(policy="record", memory=False),
    }
    names = ["bare", *guards]
    if device == "cuda":
        names.append("mode_only")
    block()
    starts = []
    probe = barrierguard.watch(policy="record")
    for _ in range(20):
        t0 = time.perf_counter()
        probe.start()
        probe.stop()
        starts.append(time.perf_counter() - t0)

    def run(name: str) -> float:
        if name in guards:
            guards[name].start()
            seconds = timed(block)
            guards[name].stop()
            return seconds
        if name == "mode_only":
            with _ModeOnly():
                return timed(block)
        return timed(block)

    rounds = paired_rounds(names, run, pairs)
    for g in guards.values():
        report = g.report
        # The only syncs are timed()'s own synchronize calls around each block.
        assert all(s.file.endswith("_common.py") for s in report.sites), report
        assert report.steps == steps * pairs, report.steps
    return {
        "start_stop_us": median(starts) * 1e6,
        "steps_per_block": steps,
        "pairs": pairs,
        "layers": layers,
        "width": width,
        **paired_summary(rounds, names, steps),
    }


def per_sync(calls: int, repeats: int) -> dict[str, Any]:
    x = torch.ones(16, device="cuda")

    def loop() -> None:
        for _ in range(calls):
            x.item() if x.numel() == 1 else x[0].item()

    loop()
    results: dict[str, list[float]] = {"bare": [], "watched": [], "naive": []}
    for _ in range(repeats):
        results["bare"].append(timed(loop) / calls)
        with barrierguard.watch(engine="cuda", policy="record") as guard:
            guard.step()
            results["watched"].append(timed(loop) / calls)
        items = [s for s in guard.report.sites if s.kind == "item"]
        assert sum(s.count for s in items) == calls, guard.report
        with NaiveSyncDebug() as naive:
            results["naive"].append(timed(loop) / calls)
        assert len(naive.records) == calls, len(naive.records)
    med = {k: median(v) * 1e6 for k, v in results.items()}
    return {
        "calls": calls,
        "us_bare": med["bare"],
        "us_watched": med["watched"],
        "us_naive": med["naive"],
        "us_added_watched": med["watched"] - med["bare"],
        "us_added_naive": med["naive"] - med["bare"],
        "samples_us": {k: [t * 1e6 for t in v] for k, v in results.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--pairs", type=int, default=80)
    ap.add_argument("--layers", type=int, default=0, help="0: calibrate to --target-ms")
    ap.add_argument("--target-ms", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    layers = args.layers or adam_mlp_layers(args.device, args.width, args.target_ms)
    ov = overhead(args.device, args.steps, args.pairs, layers, args.width)
    results["overhead"] = ov
    print(f"\n## watch() on a launch-bound step (no sync in it), {layers} layers of {args.width}")
    rows = []
    for name, ms in ov["step_ms"].items():
        ratio = ov["ratio_median"].get(name)
        q = ov["ratio_quartiles"].get(name)
        rows.append(
            [
                name,
                f"{ms:.3f}",
                f"{ratio:.4f}" if ratio else "1",
                f"{q[0]:.3f}-{q[1]:.3f}" if q else "-",
            ]
        )
    print(
        table(
            ["variant", "step ms (median)", "ratio to bare (median of paired)", "ratio IQR"], rows
        )
    )
    print(
        f"{ov['pairs']} interleaved rounds x {ov['steps_per_block']} steps; one start()+stop(): {ov['start_stop_us']:.0f} us"
    )
    if args.device == "cuda":
        ps = per_sync(args.calls, args.repeats)
        results["per_sync"] = ps
        print("\n## cost of one recorded .item() on an idle GPU (us per call, median)")
        print(
            table(
                [
                    "bare",
                    "watch()",
                    "naive hook (extract_stack)",
                    "added by watch()",
                    "added by naive",
                ],
                [
                    [
                        f"{ps['us_bare']:.1f}",
                        f"{ps['us_watched']:.1f}",
                        f"{ps['us_naive']:.1f}",
                        f"{ps['us_added_watched']:.1f}",
                        f"{ps['us_added_naive']:.1f}",
                    ]
                ],
            )
        )
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
