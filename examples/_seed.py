"""Helpers shared by the seed examples: device choice, timing, tables, watched runs.

Not an example itself. Each example imports it from its own folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import barrierguard


def base_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every seed example takes."""
    parser = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per variant")
    parser.add_argument(
        "--watch-steps", type=int, default=6, help="steps each variant runs under watch()"
    )
    parser.add_argument(
        "--report-dir", metavar="DIR", help="save each variant's report as DIR/<variant>.json"
    )
    parser.add_argument(
        "--engine", default="auto", help="barrierguard engine: auto, cuda or audit (default auto)"
    )
    parser.add_argument("--json", metavar="FILE", help="write the timing table as JSON to FILE")
    parser.add_argument(
        "--no-watch", action="store_true", help="timing table only, no barrierguard reports"
    )
    return parser


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def wait(device: torch.device) -> None:
    """Wait for the device's queue (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds from a drained queue until ``fn``'s work has finished on the device."""
    wait(device)
    t0 = time.perf_counter()
    fn()
    wait(device)
    return time.perf_counter() - t0


def compare(
    variants: dict[str, Callable[[], Any]], device: torch.device, repeats: int
) -> dict[str, list[float]]:
    """Time each variant ``repeats`` times, interleaved, after one warm-up run each."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(repeats):
        # Rotate the order so no variant always runs right after another.
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(time_it(variants[name], device))
    return times


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def timing_table(times: dict[str, list[float]], base: str, unit_steps: int) -> str:
    """Median time per step of each variant, and its ratio to ``base``."""
    ref = statistics.median(times[base])
    rows = []
    for name, samples in times.items():
        med = statistics.median(samples)
        rows.append(
            [
                name,
                f"{med * 1e3:.2f}",
                f"{med / unit_steps * 1e3:.4f}",
                f"{med / ref:.2f}x",
            ]
        )
    return table(["variant", "total ms (median)", "ms per step", f"vs {base}"], rows)


def save_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def watched(
    name: str, run: Callable[[barrierguard.Guard], Any], args: argparse.Namespace, **options: Any
) -> barrierguard.Report:
    """Run ``run(guard)`` under ``watch(policy="record")``, print and save its report."""
    with barrierguard.watch(policy="record", engine=args.engine, **options) as guard:
        # Kept alive until the guard stops, as a loop's variables would be.
        result = run(guard)
    del result
    return show(name, guard, args)


def show(name: str, guard: barrierguard.Guard, args: argparse.Namespace) -> barrierguard.Report:
    """Print the stopped ``guard``'s report and save it under ``--report-dir``."""
    report = guard.report
    print(f"\n### barrierguard on the {name!r} variant\n")
    print(report)
    if args.report_dir:
        Path(args.report_dir).mkdir(parents=True, exist_ok=True)
        report.save(Path(args.report_dir) / f"{name}.json")
    return report
