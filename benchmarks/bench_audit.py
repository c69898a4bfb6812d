"""Audit engine overhead: a small MLP training step on CPU, bare vs watched.

Paired, interleaved blocks (the order rotates every round); the ratio of each
pair, then the median over rounds. Run on a CPU machine (no GPU needed):

    PYTHONPATH=src python benchmarks/bench_audit.py --out benchmarks/results/audit_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, table, timed, write

import barrierguard


class _NoOpMode(TorchFunctionMode):
    """The floor of any mode-based design: a mode that only forwards."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def make_step(width: int, layers: int, batch: int) -> Any:
    """A device-agnostic training step, as a script would write it."""
    torch.manual_seed(0)
    device = torch.device("cpu")
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, 10))
    model = nn.Sequential(*mods).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs = torch.randn(batch, width)
    ys = torch.randint(0, 10, (batch,))

    def step() -> None:
        x, y = xs.to(device), ys.to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def overhead(width: int, layers: int, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    step = make_step(width, layers, batch)

    def block() -> None:
        for _ in range(steps):
            step()

    guard = barrierguard.watch(engine="audit", policy="record")
    for _ in range(3):
        block()
    names = ["bare", "audit", "noop_mode"]
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    for i in range(rounds):
        order = names[i % 3 :] + names[: i % 3]
        got: dict[str, float] = {}
        for n in order:
            if n == "audit":
                guard.start()
                got[n] = timed(block)
                guard.stop()
            elif n == "noop_mode":
                with _NoOpMode():
                    got[n] = timed(block)
            else:
                got[n] = timed(block)
        for n in names:
            times[n].append(got[n] / steps)
        for n in names[1:]:
            ratios[n].append(got[n] / got["bare"])
    report = guard.report
    # The step moves its batch with a blocking copy: 2 syncs a step, nothing else.
    kinds = sorted({(s.kind, s.detail) for s in report.sites if s.step_count})
    return {
        "width": width,
        "layers": layers,
        "batch": batch,
        "steps_per_block": steps,
        "rounds": rounds,
        "step_ms": {n: median(v) * 1e3 for n, v in times.items()},
        "ratio_median": {n: median(v) for n, v in ratios.items()},
        "ratio_quartiles": {
            n: [sorted(v)[len(v) // 4], sorted(v)[(3 * len(v)) // 4]] for n, v in ratios.items()
        },
        "kinds_found": [list(k) for k in kinds],
        "syncs_per_step": report.step_syncs / max(1, report.measured_steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = [(128, 2, 32), (256, 2, 64), (512, 3, 64)]
    results: dict[str, Any] = {"command": " ".join(sys.argv), "threads": args.threads}
    rows = []
    runs = []
    for width, layers, batch in configs:
        r = overhead(width, layers, batch, args.steps, args.rounds)
        runs.append(r)
        q = r["ratio_quartiles"]["audit"]
        rows.append(
            [
                f"{layers}x{width}, batch {batch}",
                f"{r['step_ms']['bare']:.3f}",
                f"{r['step_ms']['audit']:.3f}",
                f"{r['ratio_median']['audit']:.3f}",
                f"{q[0]:.3f}-{q[1]:.3f}",
                f"{r['ratio_median']['noop_mode']:.3f}",
                f"{r['syncs_per_step']:.1f}",
            ]
        )
    results["configs"] = runs
    print(f"\n## audit engine on a CPU MLP training step ({args.threads} thread(s))")
    print(
        table(
            [
                "MLP",
                "bare ms",
                "audit ms",
                "audit/bare (median of pairs)",
                "IQR",
                "no-op mode/bare",
                "syncs/step found",
            ],
            rows,
        )
    )
    print(f"{args.rounds} interleaved rounds x {args.steps} steps per config")
    write(args.out, results)


if __name__ == "__main__":
    main()
