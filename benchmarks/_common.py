"""Shared helpers for the benchmark scripts: timing, medians, tables, results."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    """Wall time of ``fn`` between two device synchronizations, in seconds."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def sleep_cycles_per_ms() -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond on this GPU.

    Probed with short sleeps (the median of five), like the 1 ms kernels the
    benchmarks launch: one long probe runs at a clock the short ones do not reach.
    """
    probe = 1_000_000
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        samples.append(probe / start.elapsed_time(end))
    return float(sorted(samples)[2])


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def paired_rounds(
    names: Sequence[str], run: Callable[[str], float], pairs: int
) -> list[dict[str, float]]:
    """``pairs`` interleaved rounds, each calling ``run(name)`` once per variant.

    The order rotates by one variant each round, so no variant always runs
    first (or right after the same neighbour). Returns each round's seconds by
    variant.
    """
    rounds = []
    for i in range(pairs):
        k = i % len(names)
        rounds.append({n: run(n) for n in [*names[k:], *names[:k]]})
    return rounds


def paired_summary(
    rounds: list[dict[str, float]], names: Sequence[str], steps: int, base: str = "bare"
) -> dict[str, Any]:
    """Median ms per step per variant, and each variant's ratio to ``base`` within a round."""
    ratios = {n: [r[n] / r[base] for r in rounds] for n in names if n != base}
    return {
        "step_ms": {n: median([r[n] / steps for r in rounds]) * 1e3 for n in names},
        "ratio_median": {n: median(v) for n, v in ratios.items()},
        "ratio_quartiles": {
            n: [sorted(v)[len(v) // 4], sorted(v)[(3 * len(v)) // 4]] for n, v in ratios.items()
        },
        "ratios": ratios,
    }


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def machine() -> dict[str, str]:
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(terse=True),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    return info


def write(path: str | None, results: dict[str, Any]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine(), **results}
    Path(path).write_text(json.dumps(results, indent=2) + "\n")
    print(f"results written to {path}")
