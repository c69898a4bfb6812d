"""What does memory sampling cost a training step, and is it free of syncs?

Question:
    How much slower does a training step run when ``watch()`` samples memory
    (its default) than without, and does sampling ever synchronize?

Design:
    * What each way to read memory costs the host (median of 5 x ``--calls``
      calls): torch's allocator counters, psutil, ``/proc/self/statm``, NVML;
      those marked ``(used)`` are the sampler's. Then one whole sample as the
      sampler takes it at a step boundary.
    * On the launch-bound Adam MLP step of ``bench_core.py`` (1 ms, calibrated):
      ``bare``, ``watch(memory=False)``, ``watch()`` (adaptive sampling, a budget
      of 0.25% of the step time) and ``watch(memory_every=1)`` in ``--pairs``
      paired rounds of ``--steps`` steps; the median of the per-round ratios,
      and ``watch()`` over ``watch(memory=False)`` within each round (the
      sampler alone).
    * On a GPU, 50 watched steps sampling every step under
      ``torch.cuda.set_sync_debug_mode("error")``: any sync would raise.
    * **Aftermath** (``--aftermath PAIRS``; on a CPU only the host reads): on the same step, one
      read (each probe, one whole sample, or ``is_pinned()`` of a pinned 4 MB
      batch) after every step, in paired rounds against the bare step. The step
      time it adds, less the read's own time timed around the call, is what the
      read costs the steps after it (the launches it slows): a cost the
      adaptive stride, which times only the read, cannot see.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_memory.py --out benchmarks/results/h200/memory.json

    (``bash benchmarks/run_all.sh benchmarks/results/h200`` runs it with the rest
    of the suite and keeps the printed tables in ``memory.txt``.)

    The aftermath of each read, with ``src/`` at 6cdfab9 (about a minute)::

        PYTHONPATH=src python benchmarks/bench_memory.py --aftermath 60 --pairs 0 --layers 3 \\
            --out benchmarks/results/h200/memory_aftermath.json

    CPU smoke run (the host probes only; its ratios mean nothing)::

        PYTHONPATH=src python benchmarks/bench_memory.py --device cpu --pairs 20 --layers 2 \\
            --calls 500 --out benchmarks/results/memory_cpu_smoke.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    adam_mlp_layers,
    adam_mlp_step,
    median,
    paired_rounds,
    paired_summary,
    table,
    timed,
    write,
)

import barrierguard


def overhead(device: str, steps: int, pairs: int, layers: int, width: int) -> dict[str, Any]:
    """Paired, interleaved rounds: bare loop vs watched without and with memory.

    Each guard is started before its timed block and stopped after it, so the
    time is the per-step cost, not the one-time start/stop.
    """
    step = adam_mlp_step(device, layers, width)

    def block() -> None:
        for _ in range(steps):
            step()

    # The default engine on both sides (the CUDA engine on a GPU), so the
    # difference between the two watched variants is the memory sampler alone.
    guards = {
        "watch_no_memory": barrierguard.watch(policy="record", memory=False),
        "watch_memory": barrierguard.watch(policy="record"),
        "watch_memory_every_step": barrierguard.watch(policy="record", memory_every=1),
    }
    names = ["bare", *guards]
    for _ in range(3):
        block()
    starts: dict[str, list[float]] = {n: [] for n in guards}

    def run(name: str) -> float:
        if name == "bare":
            return timed(block)
        t0 = time.perf_counter()
        guards[name].start()
        starts[name].append(time.perf_counter() - t0)
        seconds = timed(block)
        guards[name].stop()
        return seconds

    rounds = paired_rounds(names, run, pairs)
    memory_only = [r["watch_memory"] / r["watch_no_memory"] for r in rounds]
    memory = guards["watch_memory"].report.memory
    assert memory is not None
    return {
        "steps_per_block": steps,
        "pairs": pairs,
        "layers": layers,
        "width": width,
        **paired_summary(rounds, names, steps),
        "start_ms": {n: median(v) * 1e3 for n, v in starts.items()},
        "memory_vs_no_memory_median": median(memory_only),
        "adaptive_sampling": memory.sampling,
        "series": sorted(memory.series),
        "notes": list(memory.notes),
    }


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return float(statistics.median(samples))


def _nvml_reads(idx: int) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    """NVML's two memory reads of device ``idx``, and its shutdown (none where NVML fails)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # a benchmark still reports the rest
        print(f"NVML not measured: {type(exc).__name__}: {exc}")
        return {}, lambda: None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
    except Exception as exc:
        pynvml.nvmlShutdown()
        print(f"NVML not measured: {type(exc).__name__}: {exc}")
        return {}, lambda: None
    info, processes = pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlDeviceGetComputeRunningProcesses
    reads: dict[str, Callable[[], Any]] = {
        "nvmlDeviceGetMemoryInfo": lambda: info(handle),
        "nvmlDeviceGetComputeRunningProcesses": lambda: processes(handle),
    }
    return reads, pynvml.nvmlShutdown


def probe_costs(device: str, calls: int) -> dict[str, float]:
    """Microseconds per call of each way to read memory (host-side cost)."""
    import psutil

    out: dict[str, float] = {}
    proc = psutil.Process()
    out["psutil Process.memory_info().rss"] = _per_call_us(lambda: proc.memory_info().rss, calls)
    if os.path.exists("/proc/self/statm"):
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            out["pread /proc/self/statm (used)"] = _per_call_us(
                lambda: int(os.pread(fd, 128, 0).split()[1]), calls
            )
        finally:
            os.close(fd)
    if device != "cuda":
        return out
    torch.ones(1, device="cuda")
    idx = torch.cuda.current_device()
    raw = torch._C._cuda_memoryStats
    out["torch.cuda.memory_allocated"] = _per_call_us(torch.cuda.memory_allocated, calls)
    out["torch.cuda.memory_reserved"] = _per_call_us(torch.cuda.memory_reserved, calls)
    out["torch.cuda.memory_stats"] = _per_call_us(torch.cuda.memory_stats, calls)
    out["torch._C._cuda_memoryStats (used)"] = _per_call_us(lambda: raw(idx), calls)
    out["torch.cuda.mem_get_info"] = _per_call_us(torch.cuda.mem_get_info, calls)
    reads, close = _nvml_reads(idx)
    try:
        for name, read in reads.items():
            out[name] = _per_call_us(read, calls)
    except Exception as exc:  # a benchmark still reports the rest
        print(f"NVML not measured: {type(exc).__name__}: {exc}")
    finally:
        close()
    return out


def sample_cost(calls: int) -> dict[str, Any]:
    """Cost of one whole sample, as the sampler takes it at a step boundary."""
    from barrierguard import _env
    from barrierguard.session.memory import Sampler, default_probes

    notes: list[str] = []
    probes = default_probes(notes, cuda=_env.cuda_available())
    sampler = Sampler(probes.probes, notes=notes)
    step = [0]

    def one() -> None:
        step[0] += 1
        sampler.sample(step[0])

    try:
        us = _per_call_us(one, calls)
    finally:
        sampler.close()
    return {"us_per_sample": us, "series": sorted(sampler.values), "notes": notes}


def _reads(device: str) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    """The reads the aftermath compares, by name, and what closes them."""
    from barrierguard.session.memory import Sampler, default_probes

    fd = os.open("/proc/self/statm", os.O_RDONLY)
    reads: dict[str, Callable[[], Any]] = {"pread /proc/self/statm": lambda: os.pread(fd, 128, 0)}
    closers: list[Callable[[], None]] = [lambda: os.close(fd)]
    cuda = device == "cuda"
    if cuda:
        idx = torch.cuda.current_device()
        raw = torch._C._cuda_memoryStats
        pinned = torch.empty(1024 * 1024, dtype=torch.float32).pin_memory()
        reads["torch._C._cuda_memoryStats"] = lambda: raw(idx)
        reads["torch.cuda.mem_get_info"] = torch.cuda.mem_get_info
        reads["is_pinned() of a pinned 4 MB batch"] = pinned.is_pinned
        nvml, shutdown = _nvml_reads(idx)
        reads.update(nvml)
        closers.append(shutdown)
    notes: list[str] = []
    sampler = Sampler(default_probes(notes, cuda=cuda).probes, notes=notes)
    count = itertools.count()
    reads["one whole sample (the sampler's)"] = lambda: sampler.sample(next(count))
    closers.append(sampler.close)

    def close() -> None:
        for fn in closers:
            fn()

    return reads, close


def aftermath(device: str, steps: int, pairs: int, layers: int, width: int) -> dict[str, Any]:
    """Each read after every step, paired against the bare step: its own time and the rest."""
    step = adam_mlp_step(device, layers, width)
    reads, close = _reads(device)
    own: dict[str, list[float]] = {n: [] for n in reads}
    clock = time.perf_counter

    def run(name: str) -> float:
        if name == "bare":

            def block() -> None:
                for _ in range(steps):
                    step()

            return timed(block)
        read, inside = reads[name], [0.0]

        def block_with_read() -> None:
            for _ in range(steps):
                step()
                t0 = clock()
                read()
                inside[0] += clock() - t0

        seconds = timed(block_with_read)
        own[name].append(inside[0] / steps)
        return seconds

    try:
        for name in reads:
            run(name)  # each read's first call (NVML's lazy work) out of the rounds
        for _ in range(3):
            run("bare")
        names = ["bare", *reads]
        rounds = paired_rounds(names, run, pairs)
    finally:
        close()
    added = {n: median([(r[n] - r["bare"]) / steps for r in rounds]) for n in reads}
    own_us = {n: median(v) * 1e6 for n, v in own.items()}
    return {
        "steps_per_block": steps,
        "pairs": pairs,
        "layers": layers,
        "width": width,
        **paired_summary(rounds, names, steps),
        "added_us": {n: v * 1e6 for n, v in added.items()},
        "own_us": own_us,
        "after_us": {n: added[n] * 1e6 - own_us[n] for n in reads},
    }


def no_sync(device: str, steps: int, layers: int, width: int) -> dict[str, Any]:
    """Run a watched loop with sampling every step under sync-debug "error"."""
    if device != "cuda":
        return {"checked": False, "why": "needs CUDA"}
    step = adam_mlp_step(device, layers, width)
    step()
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with barrierguard.watch(policy="record", engine="audit", memory_every=1) as guard:
            for _ in range(steps):
                step()
                guard.step()
        memory = guard.report.memory
    finally:
        torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()
    assert memory is not None
    return {"checked": True, "steps": steps, "samples": len(memory.steps), "raised": False}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--pairs", type=int, default=80)
    ap.add_argument("--layers", type=int, default=0, help="0: calibrate to --target-ms")
    ap.add_argument("--target-ms", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--aftermath", type=int, default=0, metavar="PAIRS", help="each read's aftermath"
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    layers = args.layers or adam_mlp_layers(args.device, args.width, args.target_ms)

    if args.aftermath:
        am = aftermath(args.device, args.steps, args.aftermath, layers, args.width)
        results["aftermath"] = am
        print(f"\n## each read after every step, {layers} layers of {args.width}")
        print(f"bare step {am['step_ms']['bare']:.3f} ms; {am['pairs']} paired rounds")
        print(
            table(
                ["read", "added us/step", "own us", "aftermath us", "ratio to bare (95% CI)"],
                [
                    [
                        n,
                        f"{am['added_us'][n]:.1f}",
                        f"{am['own_us'][n]:.1f}",
                        f"{am['after_us'][n]:.1f}",
                        f"{am['ratio_median'][n]:.4f} "
                        f"({am['ratio_ci95'][n][0]:.4f}-{am['ratio_ci95'][n][1]:.4f})",
                    ]
                    for n in am["added_us"]
                ],
            )
        )
    if not args.pairs:
        write(args.out, results)
        return results

    costs = probe_costs(args.device, args.calls)
    results["probe_us"] = costs
    print("\n## cost of one read (us per call, median of 5 x calls)")
    print(table(["read", "us"], [[k, f"{v:.2f}"] for k, v in costs.items()]))

    sc = sample_cost(args.calls)
    results["sample"] = sc
    print(f"\none whole sample ({', '.join(sc['series'])}): {sc['us_per_sample']:.2f} us")

    ov = overhead(args.device, args.steps, args.pairs, layers, args.width)
    results["overhead"] = ov
    print(f"\n## memory sampling on a launch-bound step, {layers} layers of {args.width}")
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
                f"{ov['start_ms'][name]:.2f}" if name in ov["start_ms"] else "-",
            ]
        )
    print(
        table(
            [
                "variant",
                "step ms (median)",
                "ratio to bare (median of paired)",
                "ratio IQR",
                "start() ms",
            ],
            rows,
        )
    )
    print(f"{ov['pairs']} interleaved rounds x {ov['steps_per_block']} steps")
    print(f"adaptive sampling: {ov['adaptive_sampling']}")
    print(
        "memory sampling alone (watch_memory / watch_no_memory, median of paired): "
        f"{ov['memory_vs_no_memory_median']:.4f}"
    )

    ns = no_sync(args.device, 50, layers, args.width)
    results["no_sync"] = ns
    print(f"\nno sync under sync-debug 'error' with a sample every step: {ns}")
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
