"""An asynchronous loop against one that waits for the device every iteration.

    python examples/async_vs_sync.py                 # CUDA when available: real sizes
    python examples/async_vs_sync.py --device cpu --steps 50 --size 32

Each iteration makes a random matrix and multiplies it by itself on the device.
The host only queues that work, so without a wait it runs ahead and the device
never idles. ``torch.cuda.synchronize()`` in the loop makes the host wait for
the device every iteration: the two stop overlapping and the loop gets slower
(on an H200, 1000 iterations of 100x100: 22.1 ms asynchronous, 29.9 ms with
a synchronize per iteration, 1.35x; see docs/guide.md).

The second table is the other side of asynchrony: a timer read right after
queueing device work measures the queueing, not the work. Time device work
between two synchronizations (or with CUDA events).

On a CPU there is no queue: both loops run the same work and the tables show
no difference. barrierguard's report still points at the line that would wait
on a GPU (the audit engine records ``torch.cuda.synchronize()`` on a CPU-only
build instead of failing).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _seed

import barrierguard


def loop(device: torch.device, steps: int, size: int, sync: bool, audited: bool = False) -> None:
    """``steps`` iterations of randn + mm; ``sync`` waits for the device in each."""
    for _ in range(steps):
        a = torch.randn(size, size, device=device)
        b = a @ a
        if sync and (device.type == "cuda" or audited):
            torch.cuda.synchronize()  # the host waits here until the device is idle
        del b


def timing_lesson(device: torch.device, size: int, count: int) -> list[list[str]]:
    """What a timer says about ``count`` matmuls: numpy, torch queued, torch finished."""
    host = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    t0 = time.perf_counter()
    for _ in range(count):
        host @ host
    numpy_ms = (time.perf_counter() - t0) * 1e3
    a = torch.randn(size, size, device=device)
    (a @ a).sum()  # warm-up: library handles, allocator
    _seed.wait(device)
    t0 = time.perf_counter()
    for _ in range(count):
        out = a @ a
    queued_ms = (time.perf_counter() - t0) * 1e3
    _seed.wait(device)
    finished_ms = (time.perf_counter() - t0) * 1e3
    del out
    return [
        ["numpy (host)", f"{numpy_ms:.3f}"],
        ["torch, timer read without a sync (queued only)", f"{queued_ms:.3f}"],
        ["torch, timer read after a sync (finished)", f"{finished_ms:.3f}"],
    ]


def main(argv: list[str] | None = None) -> dict[str, barrierguard.Report]:
    parser = _seed.base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--matmul-size", type=int, default=1000)
    parser.add_argument("--matmuls", type=int, default=10)
    args = parser.parse_args(argv)
    device = _seed.pick_device(args.device)
    print(f"device {device}, {args.steps} iterations of randn({args.size},{args.size}) @ itself")
    times = _seed.compare(
        {
            "async": lambda: loop(device, args.steps, args.size, sync=False),
            "sync every iteration": lambda: loop(device, args.steps, args.size, sync=True),
        },
        device,
        args.repeats,
    )
    print(_seed.timing_table(times, "async", args.steps))
    lesson = timing_lesson(device, args.matmul_size, args.matmuls)
    print(f"\n{args.matmuls} matmuls of {args.matmul_size}x{args.matmul_size}: what a timer says")
    print(_seed.table(["measured", "ms"], lesson))
    _seed.save_json(
        args.json,
        {
            "device": str(device),
            "steps": args.steps,
            "size": args.size,
            "seconds": times,
            "timing_lesson_ms": {row[0]: float(row[1]) for row in lesson},
        },
    )
    reports: dict[str, barrierguard.Report] = {}
    if args.no_watch:
        return reports
    for name, sync in (("async", False), ("sync", True)):

        def run(guard: barrierguard.Guard, sync: bool = sync) -> None:
            for _ in range(args.watch_steps):
                loop(device, 1, args.size, sync=sync, audited=True)
                guard.step()

        reports[name] = _seed.watched(name, run, args)
    return reports


if __name__ == "__main__":
    main()
