"""Overhead of watch() against the bare loop and against what a user would reach for instead.

Three step shapes (each an optimizer step, so every tool sees step boundaries):

* ``launch``: a small MLP whose step is ~1 ms of many small kernels (the host's
  launch rate is the limit);
* ``balanced``: a calibrated host busy-wait (data preparation) plus a
  ``torch.cuda._sleep`` kernel of the same length, then a tiny model step;
* ``device``: big matmuls (the device is the limit).

Variants, each timed as one block of ``--steps`` steps between two device
synchronizations, in paired, interleaved rounds (the order rotates each round):

* ``bare``: the loop alone;
* ``watch``: ``barrierguard.watch(policy="record")`` (engine, memory sampling and
  everything else at their defaults); started before and stopped after the timed
  block: its one-time start/stop cost is reported separately;
* ``naive sync-debug``: ``torch.cuda.set_sync_debug_mode("warn")``, an "always"
  warning filter and ``warnings.showwarning`` replaced by a hook that calls
  ``traceback.extract_stack(limit=12)``; installed outside the timed block (CUDA only);
* ``torch.profiler``: ``torch.profiler.profile(with_stack=True)`` entered and
  exited inside the timed block (it collects the trace at exit, and nothing can
  be read before that); the analysis afterwards (``key_averages``) is not timed;
* ``DeviceStatsMonitor``: Lightning's callback emulated by calling what it calls,
  at batch start and batch end: ``accelerator.get_device_stats(device)``
  (``torch.cuda.memory_stats`` on CUDA, psutil's CPU stats on a CPU) and the key
  prefixing, as with ``log_every_n_steps=1``; the logger's own write is not included
  (Lightning's default ``log_every_n_steps=50`` divides the added cost by ~50);
* ``.item() logging``: ``loss.item()`` after every step.

GPU (the numbers in docs/benchmarks.md):

    PYTHONPATH=src python benchmarks/bench_alternatives.py --out benchmarks/results/alternatives.json

CPU smoke test (seconds; the ratios mean nothing there):

    PYTHONPATH=src python benchmarks/bench_alternatives.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, sleep_cycles_per_ms, table, write

import barrierguard

Step = Callable[[], torch.Tensor]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def busy_wait(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def mlp(device: str, width: int, layers: int, out: int = 1) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, out)).to(device)


def train_step(model: nn.Module, x: torch.Tensor) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def measure_ms(step: Step, device: str, n: int = 20) -> float:
    for _ in range(3):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - t0) / n * 1e3


def launch_shape(device: str, width: int, target_ms: float) -> tuple[Step, dict[str, Any]]:
    """The layer count whose step is closest to ``target_ms``: small kernels, many of them."""
    torch.manual_seed(0)
    x = torch.randn(64, width, device=device)
    best: tuple[float, int, Step] | None = None
    for layers in (1, 2, 4, 6, 8, 12, 16):
        step = train_step(mlp(device, width, layers), x)
        ms = measure_ms(step, device)
        if best is None or abs(ms - target_ms) < best[0]:
            best = (abs(ms - target_ms), layers, step)
    assert best is not None
    return best[2], {"layers": best[1], "width": width, "batch": 64}


def _calibrate_in_loop(
    cycles: int, host_ms: float, inner: Step, rounds: int = 3
) -> tuple[int, float]:
    """Rescale ``cycles`` until the sleep kernel lasts ``host_ms`` inside the loop itself.

    The GPU's clock in the loop (a busy-wait on the host, a sleep, a tiny step)
    is not the clock of an isolated probe, so the kernel is timed with CUDA
    events where it runs, and the cycle count scaled by the median, a few times.
    """
    took = float("nan")
    for _ in range(rounds):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(10)
        ]
        for start, end in events:
            busy_wait(host_ms)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            inner()
        torch.cuda.synchronize()
        took = median([start.elapsed_time(end) for start, end in events])
        cycles = max(1, int(cycles * host_ms / took))
    return cycles, took  # took: the kernel's ms before the last rescaling


def balanced_shape(device: str, host_ms: float) -> tuple[Step, dict[str, Any]]:
    """Host preparation and device compute of the same length, then a tiny model step."""
    torch.manual_seed(0)
    inner = train_step(mlp(device, 64, 1), torch.randn(8, 64, device=device))
    measured: dict[str, Any] = {}
    if device == "cuda":
        n, took = _calibrate_in_loop(int(host_ms * sleep_cycles_per_ms()), host_ms, inner)
        cycles = [n]
        measured["sleep_ms_in_loop"] = round(took, 3)

        def device_work() -> None:
            torch.cuda._sleep(cycles[0])

    else:

        def device_work() -> None:
            busy_wait(host_ms)  # no device: the same time, spent on the host

    def step() -> torch.Tensor:
        busy_wait(host_ms)  # data preparation on the host
        device_work()
        return inner()

    return step, {"host_ms": host_ms, "device_ms": host_ms, **measured}


def device_shape(device: str, width: int, batch: int, layers: int) -> tuple[Step, dict[str, Any]]:
    torch.manual_seed(0)
    x = torch.randn(batch, width, device=device)
    return train_step(mlp(device, width, layers), x), {
        "width": width,
        "batch": batch,
        "layers": layers,
    }


SHAPE_TITLES = {
    "launch": "launch-bound step",
    "balanced": "balanced step (host preparation = device compute)",
    "device": "device-bound step",
}


# -- variants ---------------------------------------------------------------------
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


def timed_block(fn: Callable[[], None], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


class NaiveSyncDebug:
    """Sync-debug warn mode, an 'always' filter, and a stack-walking showwarning."""

    def __init__(self) -> None:
        self.records: list[traceback.StackSummary] = []

    def __enter__(self) -> NaiveSyncDebug:
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.filterwarnings("always", message=".*called a synchronizing CUDA operation")
        warnings.filterwarnings("ignore", message="Synchronization debug mode")
        saved = warnings.showwarning
        records = self.records

        def hook(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
            if "synchronizing CUDA operation" in str(message):
                records.append(traceback.extract_stack(limit=12))
                return
            saved(message, category, filename, lineno, *rest)

        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(0)
        self._filters.__exit__(None, None, None)  # restores showwarning and the filters


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
        return timed_block(lambda: run_loop(step, steps), device)

    def watched() -> float:
        guard.start()
        try:
            return timed_block(lambda: run_loop(step, steps), device)
        finally:
            guard.stop()

    def naive_debug() -> float:
        with naive:
            return timed_block(lambda: run_loop(step, steps), device)

    variants: dict[str, Callable[[], float]] = {"bare": bare, "watch": watched}
    if device == "cuda":
        variants["naive sync-debug"] = naive_debug
    variants["torch.profiler"] = lambda: timed_block(profiled, device)
    variants["DeviceStatsMonitor"] = lambda: timed_block(
        lambda: run_loop(step, steps, dsm_before, dsm_after), device
    )
    variants[".item() logging"] = lambda: timed_block(
        lambda: run_loop(step, steps, after=item_logging(items)), device
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
    seconds: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names if n != "bare"}
    for i in range(rounds):
        got = {n: variants[n]() for n in names[i % len(names) :] + names[: i % len(names)]}
        for n in names:
            seconds[n].append(got[n])
            if n != "bare":
                ratios[n].append(got[n] / got["bare"])
    report = guard.report
    in_steps = sorted({f"{Path(s.file).name}:{s.line} {s.kind}" for s in report.sites})

    def quartiles(xs: list[float]) -> list[float]:
        s = sorted(xs)
        return [s[len(s) // 4], s[(3 * len(s)) // 4]]

    return {
        "steps_per_block": steps,
        "rounds": rounds,
        "step_ms": {n: median(v) / steps * 1e3 for n, v in seconds.items()},
        "ratio_median": {n: median(v) for n, v in ratios.items()},
        "ratio_quartiles": {n: quartiles(v) for n, v in ratios.items()},
        "ratios": ratios,
        "watch_start_stop_us": median(starts) * 1e6,
        "watch_engine": report.engine,
        "watch_sites": in_steps,
        "watch_steps_seen": report.steps,
        "naive_records": len(naive.records),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny settings: a smoke test")
    ap.add_argument("--steps", type=int, default=50, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds per shape")
    ap.add_argument("--shapes", default="launch,balanced,device")
    ap.add_argument("--launch-ms", type=float, default=1.0)
    ap.add_argument("--launch-width", type=int, default=256)
    ap.add_argument("--balanced-ms", type=float, default=1.0, help="host ms = device ms")
    ap.add_argument("--device-width", type=int, default=4096)
    ap.add_argument("--device-batch", type=int, default=2048)
    ap.add_argument("--device-layers", type=int, default=2)
    ap.add_argument("--lightning-rounds", type=int, default=5, help="0: no Lightning rows")
    ap.add_argument("--lightning-steps", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 3, 3
        args.launch_ms, args.launch_width, args.balanced_ms = 0.2, 32, 0.2
        args.device_width, args.device_batch, args.device_layers = 64, 64, 1
        args.lightning_rounds, args.lightning_steps = min(args.lightning_rounds, 1), 4
    results: dict[str, Any] = {"command": " ".join(sys.argv), "device": args.device, "shapes": {}}
    shapes: dict[str, Step] = {}
    for shape in args.shapes.split(","):
        if shape == "launch":
            step, config = launch_shape(args.device, args.launch_width, args.launch_ms)
        elif shape == "balanced":
            step, config = balanced_shape(args.device, args.balanced_ms)
        elif shape == "device":
            step, config = device_shape(
                args.device, args.device_width, args.device_batch, args.device_layers
            )
        else:
            ap.error(f"--shapes: unknown shape {shape!r}; use launch, balanced, device")
        shapes[shape] = step
        config["bare_step_ms"] = measure_ms(step, args.device)
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
    if args.lightning_rounds:
        results["lightning"] = lightning_rows(args, shapes)
    write(args.out, results)
    return results


def _fit_seconds(step: Step, steps: int, device: str, guarded: bool) -> float:
    """One ``Trainer.fit`` whose training step runs ``step``; seconds between train start and end."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Shape(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.anchor = nn.Parameter(torch.zeros(1))
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            step()  # the shape's own forward, backward and optimizer step

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([self.anchor], lr=0.0)

    class Clock(pl.Callback):
        seconds = 0.0
        t0 = 0.0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            sync(device)
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            sync(device)
            self.seconds = time.perf_counter() - self.t0

    clock = Clock()
    callbacks: list[Any] = [clock]
    if guarded:
        callbacks.insert(
            0, barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
        )
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_epochs=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
        callbacks=callbacks,
    )
    data = DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)
    trainer.fit(Shape(), data)
    return clock.seconds


def lightning_rows(args: argparse.Namespace, shapes: dict[str, Step]) -> dict[str, Any]:
    """The Lightning callback: fits with and without it, per shape, paired and interleaved."""
    out: dict[str, Any] = {}
    print("\n## Lightning callback: a fit with BarrierGuard() against the same fit without")
    rows = []
    for shape, step in shapes.items():
        _fit_seconds(step, args.lightning_steps, args.device, True)  # warm-up
        ratios, bare, guarded = [], [], []
        for i in range(args.lightning_rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {g: _fit_seconds(step, args.lightning_steps, args.device, g) for g in order}
            bare.append(got[False])
            guarded.append(got[True])
            ratios.append(got[True] / got[False])
        q = sorted(ratios)
        out[shape] = {
            "steps": args.lightning_steps,
            "rounds": args.lightning_rounds,
            "bare_s": bare,
            "guarded_s": guarded,
            "ratios": ratios,
            "ratio_median": median(ratios),
            "ratio_quartiles": [q[len(q) // 4], q[(3 * len(q)) // 4]],
        }
        rows.append(
            [
                shape,
                f"{median(bare) / args.lightning_steps * 1e3:.3f}",
                f"{median(guarded) / args.lightning_steps * 1e3:.3f}",
                f"{median(ratios):.3f}",
                f"{q[len(q) // 4]:.3f}-{q[(3 * len(q)) // 4]:.3f}",
            ]
        )
    print(
        table(
            ["shape", "ms per step without", "ms per step with", "ratio (median)", "ratio IQR"],
            rows,
        )
    )
    print(
        f"{args.lightning_rounds} interleaved pairs of fits of {args.lightning_steps} steps per "
        "shape; each fit timed from on_train_start to on_train_end"
    )
    return out


if __name__ == "__main__":
    main()
