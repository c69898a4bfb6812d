"""Benchmark: logging 8 metrics per step with ``.item()`` vs ``MetricBuffer`` vs not at all.

Each step does host preparation (a busy wait of ``--host-ms``, standing for batch
building) and device compute (``torch.cuda._sleep`` calibrated to ``--device-ms``,
then one small matmul that yields the 8 metric values). Three loops run the same
body and differ only in logging:

* ``nothing``: computes the metrics and drops them;
* ``item``: ``running[k] += value.item()`` for each of the 8 metrics every step;
* ``buffer``: ``MetricBuffer.update(...)`` every step, ``compute()`` once at the end.

The variants run interleaved (nothing, item, buffer, nothing, ...) ``--repeats``
times after a warm-up; each is timed over the whole loop with
``torch.cuda.synchronize()`` only before and after it. The report gives medians
and the ratios ``item / buffer`` (target >= 1.6) and ``buffer / nothing``
(target <= 1.03), as a markdown table and as JSON (``--out``).

Usage:
    python benchmarks/bench_metrics.py                       # CUDA, 1000 steps
    python benchmarks/bench_metrics.py --device cpu --steps 50 --repeats 2  # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import sleep_cycles_per_ms

from barrierguard import MetricBuffer

SPECS: dict[str, Any] = {
    "loss": ("mean", "weighted"),
    "acc": ("mean", "weighted"),
    "ppl": "mean",
    "tokens": ("sum", "weighted"),
    "grad_norm": "max",
    "loss_min": "min",
    "scale": "last",
    "steps": "count",
}
NAMES = tuple(SPECS)
BATCH = 32


def host_prepare(seconds: float) -> None:
    """Stand-in for building a batch on the host: busy for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class DeviceWork:
    """About ``device_ms`` of device time per step, ending in 8 scalar metric tensors."""

    def __init__(self, device: torch.device, device_ms: float) -> None:
        self.device = device
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.randn(len(NAMES), 64, generator=gen).to(device)
        self.x = torch.randn(64, generator=gen).to(device)
        self.cycles = 0
        self.cpu_reps = 0
        if device.type == "cuda":
            self.cycles = max(1, int(device_ms * sleep_cycles_per_ms()))
        else:
            self.cpu_reps = self._calibrate_cpu(device_ms)

    def _calibrate_cpu(self, device_ms: float) -> int:
        a = torch.randn(64, 64)
        t0 = time.perf_counter()
        for _ in range(50):
            a @ a
        per = (time.perf_counter() - t0) / 50
        self.cpu_a = a
        return max(1, int(device_ms / 1000 / per))

    def step(self, i: int) -> tuple[dict[str, torch.Tensor], int]:
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        else:
            for _ in range(self.cpu_reps):
                self.cpu_a @ self.cpu_a
        out = torch.tanh(self.weight @ (self.x * (1.0 + 1e-3 * (i % 7))))
        return dict(zip(NAMES, out.unbind(0), strict=True)), BATCH


def loop_nothing(work: DeviceWork, steps: int, host_s: float) -> None:
    for i in range(steps):
        host_prepare(host_s)
        work.step(i)


def loop_item(work: DeviceWork, steps: int, host_s: float) -> dict[str, float]:
    running = dict.fromkeys(NAMES, 0.0)
    for i in range(steps):
        host_prepare(host_s)
        metrics, _ = work.step(i)
        for name, value in metrics.items():
            running[name] += value.item()  # the barrier everyone writes
    return {k: v / steps for k, v in running.items()}


def loop_buffer(work: DeviceWork, steps: int, host_s: float) -> dict[str, Any]:
    buf = MetricBuffer(SPECS, default=None)
    for i in range(steps):
        host_prepare(host_s)
        metrics, n = work.step(i)
        buf.update(**metrics, n=n)
    return buf.compute()


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20, help="steps per variant first")
    parser.add_argument("--host-ms", type=float, default=1.0)
    parser.add_argument("--device-ms", type=float, default=1.0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "metrics.json"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    host_s = args.host_ms / 1000
    work = DeviceWork(device, args.device_ms)
    loops: dict[str, Callable[[], Any]] = {
        "nothing": lambda: loop_nothing(work, args.steps, host_s),
        "item": lambda: loop_item(work, args.steps, host_s),
        "buffer": lambda: loop_buffer(work, args.steps, host_s),
    }
    for warm in (loop_nothing, loop_item, loop_buffer):
        timed(lambda warm=warm: warm(work, args.warmup, host_s), device)  # type: ignore[misc]
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.repeats):
        for name, fn in loops.items():
            times[name].append(timed(fn, device))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    result: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "torch": torch.__version__,
        "steps": args.steps,
        "repeats": args.repeats,
        "host_ms": args.host_ms,
        "device_ms": args.device_ms,
        "metrics_per_step": len(NAMES),
        "times_s": times,
        "median_s": median,
        "ms_per_step": {k: 1000 * v / args.steps for k, v in median.items()},
        "item_over_buffer": median["item"] / median["buffer"],
        "buffer_over_nothing": median["buffer"] / median["nothing"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{len(NAMES)} metrics/step, {args.steps} steps, {args.repeats} repeats on {result['device_name']} ({device})"
    )
    print(f"host prep {args.host_ms} ms/step, device compute {args.device_ms} ms/step\n")
    print("| loop | median (s) | ms/step | vs nothing |")
    print("|---|---:|---:|---:|")
    for name in loops:
        ratio = median[name] / median["nothing"]
        print(f"| {name} | {median[name]:.4f} | {result['ms_per_step'][name]:.3f} | {ratio:.3f}x |")
    print(
        f"\nitem / buffer = {result['item_over_buffer']:.2f}x (target >= 1.6); "
        f"buffer / nothing = {result['buffer_over_nothing']:.3f} (target <= 1.03)"
    )
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
