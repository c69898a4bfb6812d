"""What does the audit engine cost a training step on CPU?

Question:
    On a CPU-only machine ``watch()`` uses the audit engine, a
    ``TorchFunctionMode`` that follows which tensors would live on the device.
    How much slower does a small training step run under it (the target: at
    most 1.5x)?

Design:
    Adam steps of small MLPs (``--configs``, WIDTHxHIDDEN_LAYERS, batch 64, a
    ``non_blocking`` batch copy, forward, cross-entropy, backward), with no sync
    in the step, so what is measured is the price of watching, not of recording.
    The guard is started while the model is built (as under ``barrierguard
    run``), so the audit follows every tensor from its creation. Variants
    ``bare``, ``audit`` (a running ``watch(engine="audit")``) and, for scale, a
    no-op ``TorchFunctionMode`` time blocks of ``--steps`` steps in ``--pairs``
    paired rounds (the order rotating); the figure is the median of the
    per-round ratios to bare, with its IQR. One torch thread (``--threads``).

Reproduce:
    PYTHONPATH=src python benchmarks/bench_audit.py --out benchmarks/results/audit_cpu.json

    On the 2-core CPU machine of the CPU results (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, paired_rounds, quartiles, table, timed, write

import barrierguard


class _Noop(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*args, **(kwargs or {}))


def make_step(width: int, layers: int, batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    device = torch.device("cpu")  # the device-agnostic script's "device"
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(width, 10)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    host_x = torch.randn(batch, width)
    host_y = torch.randint(0, 10, (batch,))

    def step() -> None:
        x = host_x.to(device, non_blocking=True)
        y = host_y.to(device, non_blocking=True)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def overhead(width: int, layers: int, batch: int, steps: int, pairs: int) -> dict[str, Any]:
    # The guard starts before the model is built, as under `barrierguard run`,
    # so the audit follows every tensor from its creation.
    guard = barrierguard.watch(engine="audit", policy="record")
    guard.start()
    step = make_step(width, layers, batch)
    guard.stop()
    noop = _Noop()

    def block() -> None:
        for _ in range(steps):
            step()

    for _ in range(3):
        block()

    def run(name: str) -> float:
        if name == "audit":
            guard.start()
            try:
                return timed(block)
            finally:
                guard.stop()
        if name == "noop_mode":
            with noop:
                return timed(block)
        return timed(block)

    names = ["bare", "audit", "noop_mode"]
    rounds = paired_rounds(names, run, pairs)
    ratios = {n: [r[n] / r["bare"] for r in rounds] for n in names[1:]}
    report = guard.report
    assert report.step_syncs == 0, report
    assert report.steps == steps * pairs, report.steps
    return {
        "width": width,
        "layers": layers,
        "batch": batch,
        "steps_per_block": steps,
        "pairs": pairs,
        "step_us": {n: median([r[n] / steps for r in rounds]) * 1e6 for n in names},
        "ratio_median": {n: median(v) for n, v in ratios.items()},
        "ratio_quartiles": {n: quartiles(v) for n, v in ratios.items()},
    }


def start_stop(repeats: int) -> float:
    guard = barrierguard.watch(engine="audit", policy="record")
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        guard.start()
        guard.stop()
        samples.append(time.perf_counter() - t0)
    return median(samples)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--configs",
        default="128x2,256x2,64x2",
        help="comma-separated WIDTHxHIDDEN_LAYERS; the first is the headline",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "torch_threads": torch.get_num_threads(),
        "target_ratio": 1.5,
    }
    runs = []
    rows = []
    for spec in args.configs.split(","):
        width, layers = (int(v) for v in spec.split("x"))
        ov = overhead(width, layers, args.batch, args.steps, args.pairs)
        runs.append(ov)
        q = ov["ratio_quartiles"]
        rows.append(
            [
                f"{layers + 1} Linear, width {width}, batch {args.batch}",
                f"{ov['step_us']['bare']:.0f}",
                f"{ov['step_us']['audit']:.0f}",
                f"{ov['ratio_median']['audit']:.3f} ({q['audit'][0]:.3f}-{q['audit'][1]:.3f})",
                f"{ov['ratio_median']['noop_mode']:.3f}",
            ]
        )
    results["runs"] = runs
    results["headline_ratio"] = runs[0]["ratio_median"]["audit"]
    results["start_stop_ms"] = start_stop(5) * 1e3
    print("\n## audit engine on a CPU training step (no sync in the step)")
    print(
        table(
            [
                "MLP step",
                "bare us",
                "audit us",
                "audit / bare, median (IQR)",
                "no-op TorchFunctionMode / bare",
            ],
            rows,
        )
    )
    print(
        f"{args.pairs} interleaved rounds x {args.steps} steps, {torch.get_num_threads()} torch "
        f"threads; start()+stop(): {results['start_stop_ms']:.1f} ms (after the first)"
    )
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
