"""What does ``watch()`` add to an optimizer step that reads host step counters?

Question:
    Adam, AdamW and their kin (not ``fused=True``) read each parameter's step
    counter, a host tensor, with ``item()`` once or twice a step: 157 reads a
    step for a model of 78 parameter tensors. Those reads never wait for the
    device. How much host time does ``watch(memory=False)`` add to such a step?

Design:
    A foreach AdamW step (``--params`` parameters of ``--size`` elements, so
    the device work is small and the step launch-bound) runs in blocks of
    ``--steps`` steps, bare and under a started ``watch(memory=False)``, in
    ``--pairs`` paired rounds (the order rotating; the guard is started before
    its block and stopped after it). Each block's figure is the training
    thread's CPU time per step (``thread_time``): the host work, without the
    waits. The table gives each variant's median per step and the median, with
    its quartiles, of the rounds' differences to bare. The step boundary the
    optimizer hook makes is in the watched figure; ``fused=True`` is the
    same step without host counter reads, for scale.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_optimizer.py --pin 2 \\
        --out benchmarks/results/h200/optimizer.json \\
        | tee benchmarks/results/h200/optimizer.txt

    ``benchmarks/results/h200/optimizer_ab/`` holds two alternating runs on one
    host of ``--pin 2``, ``src/`` at ee84b70 and with the optimizers' host reads
    taken past the ``item()`` wrapper (its ``README.txt`` gives the tables)::

        PYTHONPATH=src python benchmarks/bench_optimizer.py --pin 2 \\
            --out benchmarks/results/h200/optimizer_ab/optimizer_hostreads_1.json

    (``optimizer_ee84b70_1.json`` and ``_2`` the same command with ``src/`` at
    ee84b70, ``optimizer_hostreads_2.json`` the second run.)

    CPU smoke run (audit engine on a CPU, so not the GPU figure)::

        PYTHONPATH=src python benchmarks/bench_optimizer.py --device cpu --params 4 --pairs 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, paired_rounds, quartiles, sync, table, write

import barrierguard


def optimizer_step(device: str, params: int, size: int, fused: bool) -> Any:
    """One AdamW step over ``params`` small parameters (gradients set once)."""
    ps = [torch.nn.Parameter(torch.randn(size, device=device)) for _ in range(params)]
    for p in ps:
        p.grad = torch.randn_like(p)
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(ps, lr=1e-3, **kind).step


def measure(args: argparse.Namespace) -> dict[str, Any]:
    steps = {
        "foreach": optimizer_step(args.device, args.params, args.size, fused=False),
    }
    if args.device == "cuda":
        steps["fused"] = optimizer_step(args.device, args.params, args.size, fused=True)
    results: dict[str, Any] = {}
    for name, step in steps.items():
        for _ in range(10):
            step()

        def run(variant: str, step: Any = step) -> float:
            guard = (
                barrierguard.watch(policy="record", memory=False) if variant == "watch" else None
            )
            if guard is not None:
                guard.start()
            sync()
            t0 = time.thread_time()
            for _ in range(args.steps):
                step()
            sync()
            spent = (time.thread_time() - t0) / args.steps
            if guard is not None:
                guard.stop()
            return spent

        rounds = paired_rounds(("bare", "watch"), run, args.pairs)
        added = [(r["watch"] - r["bare"]) * 1e6 for r in rounds]
        results[name] = {
            "bare_us": median([r["bare"] for r in rounds]) * 1e6,
            "watch_us": median([r["watch"] for r in rounds]) * 1e6,
            "added_us_median": median(added),
            "added_us_quartiles": quartiles(added),
        }
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=78, help="parameter tensors")
    ap.add_argument("--size", type=int, default=512, help="elements per parameter")
    ap.add_argument("--steps", type=int, default=200, help="steps per block")
    ap.add_argument("--pairs", type=int, default=30, help="paired rounds")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pin", type=int, help="run on this one CPU core")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    results = measure(args)
    rows = [
        [
            f"AdamW {name}",
            f"{r['bare_us']:.1f}",
            f"{r['watch_us']:.1f}",
            f"**{r['added_us_median']:.1f}** ({r['added_us_quartiles'][0]:.1f} to "
            f"{r['added_us_quartiles'][1]:.1f})",
        ]
        for name, r in results.items()
    ]
    print(
        f"## watch(memory=False) on an AdamW step: {args.params} parameters of {args.size}, "
        f"{args.pairs} paired rounds of {args.steps} steps, host CPU time per step"
    )
    print(
        table(["step", "bare (us)", "watched (us)", "added per step, median of rounds (IQR)"], rows)
    )
    out = {"command": " ".join(sys.argv), "settings": vars(args), "optimizer": results}
    write(args.out, out)
    return out


if __name__ == "__main__":
    main()
