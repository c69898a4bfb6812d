"""Core overhead: watch() on a launch-bound step, the cost of one recorded sync,
and the size from which a non_blocking copy of pageable memory blocks.

Run on a CUDA machine:

    PYTHONPATH=src python benchmarks/bench_core.py --out benchmarks/results/core.json
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, paired_rounds, paired_summary, sync, table, timed, write

import barrierguard


def make_step(device: str, layers: int, width: int) -> Any:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*mods).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(64, width, device=device)
    host = torch.randn(64, width)
    if device == "cuda":
        host = host.pin_memory()

    def step() -> None:
        inp = host.to(device, non_blocking=True) + x
        loss = model(inp).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def calibrate(device: str, width: int, target_ms: float) -> int:
    """The layer count whose bare step is closest to ``target_ms``."""
    best, best_gap = 1, float("inf")
    for layers in (1, 2, 3, 4, 6, 8):
        step = make_step(device, layers, width)
        for _ in range(5):
            step()
        ms = median([timed(lambda s=step: [s() for _ in range(20)]) / 20 * 1e3 for _ in range(3)])
        if abs(ms - target_ms) < best_gap:
            best, best_gap = layers, abs(ms - target_ms)
    return best


class _ModeOnly:
    """Sync-debug warn mode with an 'always' filter and nothing else."""

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
    step = make_step(device, layers, width)

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


def _naive_hook() -> Any:
    saved = warnings.showwarning
    records: list[Any] = []

    def hook(message: Any, category: Any, filename: str, lineno: int, *a: Any) -> None:
        if "synchronizing CUDA operation" in str(message):
            records.append(traceback.extract_stack(limit=12))
            return
        saved(message, category, filename, lineno, *a)

    return saved, hook, records


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
        saved, hook, records = _naive_hook()
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message="called a synchronizing CUDA operation")
            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                results["naive"].append(timed(loop) / calls)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = saved
        assert len(records) == calls, len(records)
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


def _sleep_cycles_per_ms() -> float:
    cycles = 50_000_000
    torch.cuda._sleep(cycles)
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def pageable_sweep(repeats: int) -> dict[str, Any]:
    per_ms = _sleep_cycles_per_ms()
    rows = []
    for size in [
        128,
        4096,
        65536,
        262144,
        1 << 20,
        3 << 19,
        2 << 20,
        3 << 20,
        4 << 20,
        6 << 20,
        8 << 20,
    ]:
        host = torch.empty(size // 4)
        host.to("cuda", non_blocking=True)
        samples = []
        for _ in range(repeats):
            sync()
            torch.cuda._sleep(int(20 * per_ms))
            t0 = time.perf_counter()
            host.to("cuda", non_blocking=True)
            samples.append((time.perf_counter() - t0) * 1e3)
            sync()
        rows.append({"bytes": size, "host_ms": median(samples), "blocks": median(samples) > 5})
    return {"sleep_ms": 20, "sizes": rows}


def main() -> None:
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
    args = ap.parse_args()
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    layers = args.layers or calibrate(args.device, args.width, args.target_ms)
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
        sw = pageable_sweep(5)
        results["pageable_nonblocking"] = sw
        print("\n## host time of a non_blocking copy of pageable memory behind a 20 ms kernel")
        print(
            table(
                ["bytes", "host ms", "blocks"],
                [[r["bytes"], f"{r['host_ms']:.3f}", r["blocks"]] for r in sw["sizes"]],
            )
        )
    write(args.out, results)


if __name__ == "__main__":
    main()
