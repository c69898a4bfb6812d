"""``watch()`` against the bare loop and against what users reach for instead.

Question:
    What does ``watch()`` cost a training step, next to the tools a user would
    otherwise use to find syncs or watch a run (sync-debug mode with a hook,
    ``torch.profiler``, Lightning's DeviceStatsMonitor, ``.item()`` logging), on
    steps bound by the host's launches, by host and device alike, and by the
    device?

Design:
    Three step shapes, each an optimizer step so every tool sees step boundaries:

    * ``launch``: a small MLP whose step is ~1 ms of many small kernels (the
      host's launch rate is the limit);
    * ``balanced``: a 1 ms host busy-wait (data preparation), a
      ``torch.cuda._sleep`` kernel timed with CUDA events inside the loop and
      rescaled until it lasts 1 ms there, then a tiny model step;
    * ``device``: big matmuls (the device is the limit).

    Variants, each timed as one block of ``--steps`` steps between two device
    synchronizations, in ``--rounds`` paired rounds (the order rotates each
    round); the figure is the median of the per-round ratios to bare, with its IQR:

    * ``bare``: the loop alone;
    * ``watch``: ``barrierguard.watch(policy="record")`` (engine, memory sampling
      and everything else at their defaults); started before and stopped after
      the timed block: its one-time start/stop cost is reported apart;
    * ``naive sync-debug``: ``torch.cuda.set_sync_debug_mode("warn")``, an
      "always" warning filter and ``warnings.showwarning`` replaced by a hook
      that calls ``traceback.extract_stack(limit=12)``; installed outside the
      timed block (CUDA only);
    * ``torch.profiler``: ``torch.profiler.profile(with_stack=True)`` entered and
      exited inside the timed block (it collects the trace at exit, and nothing
      can be read before that); the analysis afterwards is not timed;
    * ``DeviceStatsMonitor``: Lightning's callback emulated by calling what it
      calls at batch start and end, ``accelerator.get_device_stats(device)``
      (``torch.cuda.memory_stats`` on CUDA) and the key prefixing, as with
      ``log_every_n_steps=1``; the logger's own write is not included;
    * ``.item() logging``: ``loss.item()`` after every step.

    The Lightning callback on the same shapes is ``bench_lightning_shapes.py``.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_alternatives.py --out benchmarks/results/h200/alternatives.json

    (``bash benchmarks/run_all.sh benchmarks/results/h200`` runs it with the rest
    of the suite and keeps the printed tables in ``alternatives.txt``.) The
    committed ``h200/alternatives.json`` is a run at 2c45661, after the Lightning
    rows moved to ``bench_lightning_shapes.py``: it has no ``lightning`` section.

    CPU smoke run (seconds; the ratios mean nothing there)::

        PYTHONPATH=src python benchmarks/bench_alternatives.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    SHAPE_TITLES,
    NaiveSyncDebug,
    Step,
    add_shape_args,
    build_shape,
    median,
    paired_rounds,
    paired_summary,
    shape_names,
    table,
    timed,
    write,
)

import barrierguard


def run_loop(
    step: Step,
    steps: int,
    before: Callable[[], None] | None = None,
    after: Callable[[torch.Tensor], None] | None = None,
) -> None:
    for _ in range(steps):
        if before is not None:
            before()
        loss = step()
        if after is not None:
            after(loss)


def device_stats_hooks(device: str) -> tuple[Callable[[], None], Callable[[torch.Tensor], None]]:
    """What ``DeviceStatsMonitor`` calls at batch start and end (``log_every_n_steps=1``)."""
    from lightning.pytorch.callbacks.device_stats_monitor import _prefix_metric_keys

    if device == "cuda":
        from lightning.pytorch.accelerators.cuda import CUDAAccelerator

        accelerator: Any = CUDAAccelerator()
    else:
        from lightning.pytorch.accelerators.cpu import CPUAccelerator

        accelerator = CPUAccelerator()
    root = torch.device(device)
    sink: list[dict[str, float]] = []

    def log(key: str) -> None:
        stats = accelerator.get_device_stats(root)
        sink.append(_prefix_metric_keys(stats, f"DeviceStatsMonitor.{key}", "/"))
        if len(sink) > 64:
            sink.clear()

    return (lambda: log("on_train_batch_start")), (lambda _loss: log("on_train_batch_end"))


def item_logging(sink: list[float]) -> Callable[[torch.Tensor], None]:
    def after(loss: torch.Tensor) -> None:
        sink.append(loss.item())
        if len(sink) > 1024:
            sink.clear()

    return after


def compare(step: Step, device: str, steps: int, rounds: int) -> dict[str, Any]:
    """Paired, interleaved rounds of every variant on one step shape."""
    guard = barrierguard.watch(policy="record")
    naive = NaiveSyncDebug()
    dsm_before, dsm_after = device_stats_hooks(device)
    items: list[float] = []
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def profiled() -> None:
        with torch.profiler.profile(activities=activities, with_stack=True):
            run_loop(step, steps)

    def bare() -> float:
        return timed(lambda: run_loop(step, steps))

    def watched() -> float:
        guard.start()
        try:
            return timed(lambda: run_loop(step, steps))
        finally:
            guard.stop()

    def naive_debug() -> float:
        with naive:
            return timed(lambda: run_loop(step, steps))

    variants: dict[str, Callable[[], float]] = {"bare": bare, "watch": watched}
    if device == "cuda":
        variants["naive sync-debug"] = naive_debug
    variants["torch.profiler"] = lambda: timed(profiled)
    variants["DeviceStatsMonitor"] = lambda: timed(
        lambda: run_loop(step, steps, dsm_before, dsm_after)
    )
    variants[".item() logging"] = lambda: timed(
        lambda: run_loop(step, steps, after=item_logging(items))
    )
    for fn in variants.values():  # warm-up: lazy init, profiler start-up, allocator
        fn()
    starts = []
    for _ in range(10):
        t0 = time.perf_counter()
        guard.start()
        guard.stop()
        starts.append(time.perf_counter() - t0)
    names = list(variants)
    timings = paired_rounds(names, lambda n: variants[n](), rounds)
    report = guard.report
    in_steps = sorted({f"{Path(s.file).name}:{s.line} {s.kind}" for s in report.sites})
    return {
        "steps_per_block": steps,
        "rounds": rounds,
        **paired_summary(timings, names, steps),
        "watch_start_stop_us": median(starts) * 1e6,
        "watch_engine": report.engine,
        "watch_sites": in_steps,
        "watch_steps_seen": report.steps,
        "naive_records": len(naive.records),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_shape_args(ap)
    ap.add_argument("--steps", type=int, default=50, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds per shape")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    shapes = shape_names(ap, args)
    if args.quick:
        args.steps, args.rounds = 3, 3
    results: dict[str, Any] = {"command": " ".join(sys.argv), "device": args.device, "shapes": {}}
    for shape in shapes:
        step, config = build_shape(args, shape)
        res = compare(step, args.device, args.steps, args.rounds)
        res["config"] = config
        results["shapes"][shape] = res
        print(f"\n## {SHAPE_TITLES[shape]} on {args.device}: {config}")
        rows = [["bare", f"{res['step_ms']['bare']:.3f}", "1", "-"]]
        for name, ratio in res["ratio_median"].items():
            q = res["ratio_quartiles"][name]
            rows.append(
                [name, f"{res['step_ms'][name]:.3f}", f"{ratio:.3f}", f"{q[0]:.3f}-{q[1]:.3f}"]
            )
        print(
            table(["variant", "ms per step (median)", "ratio to bare (median)", "ratio IQR"], rows)
        )
        print(
            f"{res['rounds']} interleaved rounds x {res['steps_per_block']} steps; "
            f"watch() start+stop {res['watch_start_stop_us']:.0f} us (outside the timed block); "
            f"engine {res['watch_engine']}; sites seen by watch(): {res['watch_sites'] or 'none'}"
        )
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
