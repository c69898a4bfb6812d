"""Does the merged report price a rank-0-only ``.item()`` right for the other ranks?

Question:
    In a DDP job on 2 GPUs, rank 0 alone logs ``loss.item()`` every step. The
    merged report should name that line, on rank 0 only, as rank-asymmetric,
    and estimate what it costs rank 1 per step (rank 1 waits for rank 0 at
    the next gradient all-reduce). Is that estimate within 20% of rank 1's
    measured step-time difference against the same job without the line?

Design:
    ``torchrun`` starts 2 ranks (NCCL, one GPU each). Every step does host
    work (a busy-wait of H ms, standing for batch preparation, on every rank),
    then a DDP forward and backward of an MLP sized so that the step's device
    work takes about D ms (calibrated on rank 0: width 1024, batch 8192,
    fp32, the number of layers chosen), then ``SGD.step()``. Two variants of
    the same job: ``with`` the line ``if rank == 0: logged.append(loss.item())``
    every step, and ``without`` it. Each run warms up ``--warmup`` steps,
    then runs ``--steps`` steps under ``barrierguard.watch()`` (the CUDA
    engine, memory sampling off, each rank saving its report with
    ``out=``), timed on each rank by CUDA events on its stream around the
    steps (read after the guard stopped), with the wall time after a
    synchronize next to it. The variants alternate (with, without, with,
    ...) ``--repeats`` times per config ``HxD`` (``--configs``; by default
    one where host work exceeds device work, so the sync costs its whole
    stall, and one where it does not, so it costs only the overlap it
    destroys, about H). Rank 0 merges each run's per-rank files offline (as
    ``barrierguard merge`` does) and reads the gating site: its line, the
    ranks it fired on, the asymmetric flag and its estimated cost to rank 1
    per step (``rank_summaries[1].wait_s``). The table compares that with
    rank 1's measured step time with the line minus without it (medians over
    the repeats). Pass: the report names the logging line on rank 0 only and
    the ratio estimate / measured is within 0.8-1.2.

    ``--device cpu`` runs the same job on gloo with the audit engine (a smoke
    test: nothing is timed by the engine, nothing is marked measured).

Reproduce:
    PYTHONPATH=src torchrun --nproc_per_node=2 benchmarks/bench_ranks.py --out benchmarks/results/h200x2/ranks

    About a minute on 2 GPUs. CPU smoke run::

        PYTHONPATH=src torchrun --nproc_per_node=2 benchmarks/bench_ranks.py --device cpu --steps 6 --warmup 2 --repeats 1 --configs 1x1 --out /tmp/ranks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import busy_wait, machine, table

import barrierguard
from barrierguard.cli.gate import merge_files

WIDTH = 1024
BATCH = 8192
TOLERANCE = 0.2


def _mlp(layers: int, width: int, device: torch.device) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods).to(device)


def calibrate(device: torch.device, target_ms: float) -> int:
    """Layers of the MLP whose forward, backward and SGD step take about ``target_ms``."""
    model = _mlp(2, WIDTH, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(BATCH, WIDTH, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(12):
        start.record()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 2)  # per layer
    return max(1, round(target_ms / statistics.median(times)))


class Job:
    """One rank's DDP job: host work, forward, backward, SGD; the logging line on request."""

    def __init__(self, rank: int, device: torch.device, layers: int, width: int, batch: int):
        torch.manual_seed(0)
        self.rank = rank
        self.device = device
        model = _mlp(layers, width, device)
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-6)
        self.x = torch.randn(batch, width, device=device)
        self.logged: list[float] = []

    def step(self, host_ms: float, log: bool) -> None:
        busy_wait(host_ms)  # the batch, prepared on the host
        loss = self.ddp(self.x).square().mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if log and self.rank == 0:
            self.logged.append(loss.item())  # LOG-LINE


def log_line() -> int:
    """The line of the rank-0-only ``.item()`` in this file."""
    for i, text in enumerate(Path(__file__).read_text().splitlines(), 1):
        if text.rstrip().endswith("# LOG-LINE") and "endswith" not in text:
            return i
    raise AssertionError("no LOG-LINE")


def timed_run(
    job: Job, args: argparse.Namespace, host_ms: float, log: bool, out: str
) -> dict[str, Any]:
    """Warm up, then ``--steps`` steps under watch(out=...); this rank's step time."""
    cuda = job.device.type == "cuda"
    for _ in range(args.warmup):
        job.step(host_ms, log)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    guard = barrierguard.watch(policy="record", memory=False, out=out)
    start = end = None
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    guard.start()
    t0 = time.perf_counter()
    if start is not None:
        start.record()
    try:
        for _ in range(args.steps):
            job.step(host_ms, log)
        if end is not None:
            end.record()
    finally:
        guard.stop()
    if cuda:
        assert start is not None and end is not None
        end.synchronize()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps
    event = start.elapsed_time(end) / 1e3 / args.steps if start is not None and end else None
    assert guard.report_path is not None
    return {"step_s": event if event is not None else wall, "wall_step_s": wall, "file": out}


def read_merged(files: list[str]) -> dict[str, Any]:
    """What the merged report says: the gating site and its cost to each rank."""
    merged = merge_files(files)
    gate = merged.gating_site
    found: dict[str, Any] = {
        "engine": merged.engine,
        "gating": None,
        "wait_s": {s.rank: s.wait_s for s in merged.rank_summaries},
        "host_step_s": {s.rank: s.host_step_s for s in merged.rank_summaries},
    }
    if gate is not None:
        measured = {r.rank: r.measured_steps for r in merged.ranks}
        found["gating"] = {
            "location": gate.location,
            "line": gate.line,
            "kind": gate.kind,
            "code": gate.code,
            "ranks": [r for r, _ in gate.rank_counts],
            "asymmetric": gate.asymmetric,
            "job_cost_s": gate.job_cost_s,
            "stall_per_step_s": {
                r: t / measured[r] for r, t in gate.rank_stalls if measured.get(r)
            },
        }
    return found


def run_config(job: Job, args: argparse.Namespace, host_ms: float, name: str) -> dict[str, Any]:
    world = dist.get_world_size()
    reports = os.path.join(args.out, "reports")
    runs: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
    for rep in range(args.repeats):
        for variant in ("with", "without"):
            base = os.path.join(reports, f"{name}_{variant}{rep}.json")
            mine = timed_run(job, args, host_ms, variant == "with", base)
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine["step_s"])
            record: dict[str, Any] = {"step_s": every}
            if job.rank == 0:
                files = [
                    base.replace(".json", f".rank{r}.json") if world > 1 else base
                    for r in range(world)
                ]
                merged = merge_files(files)
                merged.save(base.replace(".json", ".merged.json"))
                record["report"] = read_merged(files)
            runs[variant].append(record)
            dist.barrier()
    return runs


def summarize(name: str, runs: dict[str, list[dict[str, Any]]], measured: bool) -> dict[str, Any]:
    """Rank 1's estimate against its measured difference (medians over the repeats)."""
    rank1_with = statistics.median(r["step_s"][1] for r in runs["with"])
    rank1_without = statistics.median(r["step_s"][1] for r in runs["without"])
    rank0_with = statistics.median(r["step_s"][0] for r in runs["with"])
    rank0_without = statistics.median(r["step_s"][0] for r in runs["without"])
    gates = [r["report"]["gating"] for r in runs["with"]]
    estimates = [g["job_cost_s"] for g in gates if g is not None and g["job_cost_s"] is not None]
    waits = [r["report"]["wait_s"].get(1) for r in runs["with"]]
    gate = gates[0]
    named = all(
        g is not None and g["line"] == log_line() and g["ranks"] == [0] and g["asymmetric"]
        for g in gates
    )
    unexpected = [r["report"]["gating"] for r in runs["without"] if r["report"]["gating"]]
    estimate = statistics.median(estimates) if estimates else None
    diff = rank1_with - rank1_without
    ratio = estimate / diff if estimate is not None and measured and diff > 0 else None
    return {
        "config": name,
        "site": gate["location"] if gate else None,
        "code": gate["code"] if gate else None,
        "fired_on": gate["ranks"] if gate else None,
        "asymmetric": gate["asymmetric"] if gate else None,
        "names_the_line_on_rank_0_only": named,
        "gating_site_without_the_line": unexpected,
        "estimated_cost_to_rank1_s": estimate,
        "rank1_wait_s": waits,
        "rank0_stall_per_step_s": [g["stall_per_step_s"] for g in gates if g is not None],
        "measured": measured,
        "rank1_step_s": {"with": rank1_with, "without": rank1_without},
        "rank0_step_s": {"with": rank0_with, "without": rank0_without},
        "rank1_difference_s": diff if measured else None,
        "ratio": ratio,
        "within_tolerance": (abs(ratio - 1) <= TOLERANCE) if ratio is not None else None,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--configs",
        nargs="*",
        default=["8x5", "3x6"],
        help="HOSTxDEVICE milliseconds per step, e.g. 8x5",
    )
    ap.add_argument("--out", required=True, help="a folder for the reports and ranks.json")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "bench_ranks.py: launch it with torchrun, e.g. PYTHONPATH=src torchrun "
            "--nproc_per_node=2 benchmarks/bench_ranks.py --out DIR"
        )
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_ranks.py: --device cuda needs GPUs; use --device cpu to smoke-test")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world < 2:
            raise SystemExit("bench_ranks.py: needs 2 ranks or more (--nproc_per_node=2)")
        os.makedirs(os.path.join(args.out, "reports"), exist_ok=True)
        results: list[dict[str, Any]] = []
        configs: list[dict[str, Any]] = []
        for spec in args.configs:
            host_ms, device_ms = (float(v) for v in spec.lower().split("x"))
            layers = [calibrate(device, device_ms) if cuda and rank == 0 else 2]
            dist.broadcast_object_list(layers, src=0)
            width, batch = (WIDTH, BATCH) if cuda else (32, 16)
            job = Job(rank, device, layers[0], width, batch)
            runs = run_config(job, args, host_ms, spec)
            configs.append({"config": spec, "layers": layers[0], "width": width, "batch": batch})
            if rank == 0:
                results.append(summarize(spec, runs, measured=cuda) | {"runs": runs})
            del job
        if rank == 0:
            _report(args, results, configs, cuda)
    finally:
        dist.destroy_process_group()


def _report(
    args: argparse.Namespace, results: list[dict[str, Any]], configs: list[Any], cuda: bool
) -> None:
    rows = [
        [
            r["config"],
            r["site"] or "-",
            ",".join(map(str, r["fired_on"] or [])),
            r["asymmetric"],
            _ms(r["estimated_cost_to_rank1_s"]),
            _ms(r["rank1_difference_s"]),
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
            _ms(r["rank1_step_s"]["without"] if cuda else None),
            _ms(r["rank1_step_s"]["with"] if cuda else None),
        ]
        for r in results
    ]
    print(
        table(
            [
                "HxD ms",
                "site",
                "ranks",
                "asymmetric",
                "est. cost to rank 1 ms/step",
                "measured rank-1 diff ms/step",
                "ratio",
                "rank-1 step without",
                "with",
            ],
            rows,
        )
    )
    if not cuda:
        print("CPU smoke run: nothing was timed by the engine, nothing is marked measured")
    named = all(r["names_the_line_on_rank_0_only"] for r in results)
    within = [r["within_tolerance"] for r in results]
    print(f"the report names line {log_line()} on rank 0 only as rank-asymmetric: {named}")
    if cuda:
        print(f"estimate within {TOLERANCE:.0%} of the measured difference: {within}")
    data = {
        "machine": machine(),
        "args": vars(args),
        "log_line": log_line(),
        "configs": configs,
        "results": results,
    }
    path = os.path.join(args.out, "ranks.json")
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
    print(f"results written to {path}")


if __name__ == "__main__":
    main()
