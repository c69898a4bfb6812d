"""Memory that piles up when nothing ever waits: ``total_loss += loss`` in a loop.

    python examples/memory_pileup.py                  # CUDA when available: real sizes
    python examples/memory_pileup.py --device cpu --steps 30 --width 512

A loop that never synchronizes lets the host run ahead of the device. That is
what makes it fast, but it also means nothing in the loop looks at a value:
an accumulator written as ``total_loss += loss`` (no ``.item()``, no
``.detach()``) quietly becomes the end of an autograd graph that chains every
step's loss, and every step's saved activations stay alive through it. Memory
grows step after step until the run dies of out-of-memory, hours later.

(The queue of launched kernels is bounded: when it is full the host blocks in
the next launch. What grows without bound is what the code keeps alive.)

The fix keeps the loop asynchronous: ``total_loss += loss.detach()`` (or a
``barrierguard.MetricBuffer``). barrierguard samples memory at each step and
gives a verdict, with the cause it recognised; this example prints both
variants' verdicts and a table of their growth per step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _seed

import barrierguard


def main(argv: list[str] | None = None) -> dict[str, barrierguard.Report]:
    parser = _seed.base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--max-growth", default="1MB", help="max_growth_per_step for the verdict")
    args = parser.parse_args(argv)
    device = _seed.pick_device(args.device)
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w)).to(device)
    print(f"device {device}: {args.steps} steps of a {w}x{w} batch through a 2-layer MLP")
    reports: dict[str, barrierguard.Report] = {}
    rows = []
    for name, detach in (("pileup", False), ("detached", True)):
        t0 = time.perf_counter()
        with barrierguard.watch(
            policy="record",
            engine=args.engine,
            memory_every=1,
            warmup_steps=2,
            max_growth_per_step=args.max_growth,
        ) as guard:
            # An evaluation loop that forgot torch.no_grad(), summing the loss each step.
            total_loss = torch.zeros((), device=device)
            for _ in range(args.steps):
                x = torch.randn(w, w, device=device)
                loss = model(x).square().mean()
                if detach:
                    total_loss += loss.detach()  # a number, not a graph
                else:
                    total_loss += loss  # keeps this step's graph and activations alive
                guard.step()
            _seed.wait(device)  # after the loop: the time below includes the work
        seconds = time.perf_counter() - t0
        report = _seed.show(name, guard, args)
        del total_loss, loss, x
        reports[name] = report
        memory = report.memory
        assert memory is not None
        series = memory.verdict_series[0] if memory.verdict_series else "-"
        slope = memory.slopes.get(series)
        rows.append(
            [
                name,
                f"{seconds / args.steps * 1e3:.2f}",
                series,
                f"{slope / 1e6:+.2f}" if slope is not None else "-",
                f"{memory.peak.get(series, 0) / 1e6:.1f}",
                "LEAK" if memory.leak else "no leak",
                memory.pattern or "-",
            ]
        )
        del report
    print(f"\n### memory per variant ({args.steps} steps, sampled every step)\n")
    print(
        _seed.table(
            ["variant", "ms per step", "series", "MB per step", "peak MB", "verdict", "cause"],
            rows,
        )
    )
    _seed.save_json(
        args.json,
        {
            "device": str(device),
            "steps": args.steps,
            "header": [
                "variant",
                "ms_per_step",
                "series",
                "mb_per_step",
                "peak_mb",
                "verdict",
                "cause",
            ],
            "rows": rows,
        },
    )
    return reports


if __name__ == "__main__":
    main()
