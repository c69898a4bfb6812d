"""What does merging the ranks' reports cost as the ranks grow?

Question:
    At the end of a distributed run the ranks' reports become one: in process
    (``session.ranks.merge``: one ``gather_object`` of every rank's report to
    rank 0, then ``Report.merge`` there) or offline (each rank saves its
    own file, ``barrierguard merge`` reads them all). What does each cost in
    time, bytes and memory for 2 to 8 real processes, and for up to 1,000
    ranks, and which one scales to 1,000?

Design:
    One synthetic per-rank report of realistic size (``--sites`` sites with
    phases and per-step ranges, ``--steps`` entries of ``syncs_per_step``, a
    32-row timeline and a memory section of ``--samples`` samples of three
    series); rank 0's has one more site, fired on it alone. Part 1 spawns N
    gloo processes on this CPU (``--worlds``) and times, on rank 0, the
    in-process merge (gather_object to rank 0 + Report.merge) and the
    ``all_gather_object`` it replaced (every rank receives every report),
    each the median of ``--repeats`` rounds after a barrier, with the bytes
    of one rank's pickled report; the processes share the CPU's
    cores, so from 4 ranks on the wire time includes waiting for a core.
    Part 2 merges N copies of the report in one process (``--ranks``, up to
    1,000): the time of ``Report.merge`` alone, of the offline path
    (writing N files, then reading and merging them as ``barrierguard merge``
    does), the size of one rank's report and of the merged JSON, and the peak
    Python memory of the offline merge (tracemalloc, a separate pass).

Reproduce:
    PYTHONPATH=src python benchmarks/bench_merge.py --out benchmarks/results/merge_cpu.json

    On the 2-core CPU machine of the CPU results (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, table, write

from barrierguard import MemoryReport, Report, Site
from barrierguard.cli.gate import merge_files
from barrierguard.report.records import Timeline


def synthetic(rank: int, *, sites: int, steps: int, samples: int) -> Report:
    """A per-rank report of realistic size; rank 0 alone logs a loss."""
    made = [
        Site(
            file=f"/job/src/model/part{i % 5}.py",
            line=100 + i,
            function=f"fn{i}",
            code=f"value_{i} = tensor_{i}.item()  # a line of code of usual length",
            kind=("item", "copy", "bool", "collective")[i % 4],
            origin="user" if i % 3 else "framework:lightning",
            count=steps,
            step_count=steps - 1,
            per_step=1.0,
            steps=((1, steps // 2), (steps // 2 + 2, steps)),
            stall_s=0.001 * steps,
            stall_count=steps,
            fix="keep the value on the device and reduce once at epoch end",
            phases=(("train", steps - 1), ("validate", 1)),
            mechanisms=(("prog_bar (on_train_batch_end)", steps),) if i % 3 == 0 else (),
        )
        for i in range(sites)
    ]
    if rank == 0:
        made.append(
            Site(
                file="/job/train.py",
                line=42,
                function="train",
                code="if rank == 0: log(loss.item())",
                kind="item",
                origin="user",
                count=steps,
                step_count=steps,
                per_step=1.0,
                stall_s=0.004 * steps,
                stall_count=steps,
            )
        )
    n = 32
    memory = MemoryReport(
        steps=tuple(range(0, steps, max(1, steps // samples)))[:samples],
        series={
            name: tuple(1_000_000_000 + 4096 * k for k in range(samples))
            for name in ("host_rss", "device_allocated", "device_reserved")
        },
        slopes={"host_rss": 12.5, "device_allocated": 0.0, "device_reserved": 0.0},
        reason="flat",
    )
    return Report(
        engine="cuda",
        detection=True,
        policy="record",
        steps=steps,
        measured_steps=steps,
        sites=tuple(made),
        syncs_per_step=(0,) + (sites,) * steps,
        duration_s=600.0,
        environment={"torch": torch.__version__, "python": sys.version.split()[0]},
        timeline=Timeline(
            steps=tuple(range(1, n + 1)),
            host_s=(0.0123,) * n,
            stall_s=(0.004,) * n,
            device_s=(0.0101,) * n,
            ahead=(0,) * n,
            saving_s=0.004 * n,
        ),
        memory=memory,
        rank=rank,
    )


# -- part 1: real processes -------------------------------------------------------------


def _worker(rank: int, world: int, port: int, out: str, cfg: dict[str, int]) -> None:
    import torch.distributed as dist

    from barrierguard.session import rank_reports

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        local = synthetic(rank, sites=cfg["sites"], steps=cfg["steps"], samples=cfg["samples"])
        times: dict[str, list[float]] = {"all_gather_object": [], "gather_object": []}
        for _ in range(cfg["repeats"]):
            dist.barrier()
            t0 = time.perf_counter()
            rank_reports.merge(local)  # gather_object to rank 0
            times["gather_object"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            got: list[Any] = [None] * world
            dist.all_gather_object(got, local.to_dict())
            if rank == 0:
                Report.merge([Report.from_dict(d) for d in got])
            times["all_gather_object"].append(time.perf_counter() - t0)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def in_process(world: int, cfg: dict[str, int]) -> dict[str, Any]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        torch.multiprocessing.start_processes(
            _worker, args=(world, port, out, cfg), nprocs=world, start_method="spawn"
        )
        times = json.loads(Path(out).read_text())
    one = synthetic(1, sites=cfg["sites"], steps=cfg["steps"], samples=cfg["samples"])
    return {
        "world": world,
        "pickled_report_kb": len(pickle.dumps(one.to_dict())) / 1e3,
        "all_gather_object_ms": median(times["all_gather_object"]) * 1e3,
        "gather_object_ms": median(times["gather_object"]) * 1e3,
        "rounds": times,
    }


# -- part 2: many synthetic ranks in one process ------------------------------------------


def one_process(n: int, cfg: dict[str, int], *, peak: bool) -> dict[str, Any]:
    reports = [
        synthetic(r, sites=cfg["sites"], steps=cfg["steps"], samples=cfg["samples"])
        for r in range(n)
    ]
    t0 = time.perf_counter()
    merged = Report.merge(reports)
    merge_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    text = json.dumps(merged.to_dict(), indent=2)
    dump_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        t0 = time.perf_counter()
        for r in reports:
            path = os.path.join(tmp, f"bg.rank{r.rank}.json")
            r.save(path)
            paths.append(path)
        write_s = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        offline = merge_files(paths)
        offline_s = time.perf_counter() - t0
        assert offline == merged
        peak_mb = None
        if peak:
            del offline
            tracemalloc.start()
            merge_files(paths)
            peak_mb = tracemalloc.get_traced_memory()[1] / 1e6
            tracemalloc.stop()
    return {
        "ranks": n,
        "rank_report_kb": len(json.dumps(reports[0].to_dict(), indent=2)) / 1e3,
        "merge_ms": merge_s * 1e3,
        "merged_json_mb": len(text) / 1e6,
        "merged_dump_ms": dump_s * 1e3,
        "save_one_rank_ms": write_s * 1e3,
        "offline_merge_ms": offline_s * 1e3,
        "offline_peak_mb": peak_mb,
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 8, 64, 256, 1000])
    ap.add_argument("--peak-up-to", type=int, default=1000, help="tracemalloc pass up to N")
    ap.add_argument("--sites", type=int, default=20)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cfg = {
        "sites": args.sites,
        "steps": args.steps,
        "samples": args.samples,
        "repeats": args.repeats,
    }
    procs = [in_process(w, cfg) for w in args.worlds]
    if procs:
        print(
            f"in process, gloo on {os.cpu_count()} CPU cores (median of {args.repeats}); "
            f"one rank's report pickles to {procs[0]['pickled_report_kb']:.1f} KB:"
        )
        print(
            table(
                ["ranks", "gather_object + merge ms (used)", "all_gather_object + merge ms"],
                [
                    [p["world"], f"{p['gather_object_ms']:.1f}", f"{p['all_gather_object_ms']:.1f}"]
                    for p in procs
                ],
            )
        )
    synth = [one_process(n, cfg, peak=n <= args.peak_up_to) for n in args.ranks]
    print("\none process, synthetic ranks:")
    print(
        table(
            [
                "ranks",
                "one rank KB",
                "Report.merge ms",
                "merged JSON MB",
                "dump ms",
                "save one rank ms",
                "offline merge ms",
                "offline peak MB",
            ],
            [
                [
                    s["ranks"],
                    f"{s['rank_report_kb']:.1f}",
                    f"{s['merge_ms']:.1f}",
                    f"{s['merged_json_mb']:.2f}",
                    f"{s['merged_dump_ms']:.0f}",
                    f"{s['save_one_rank_ms']:.2f}",
                    f"{s['offline_merge_ms']:.0f}",
                    "-" if s["offline_peak_mb"] is None else f"{s['offline_peak_mb']:.0f}",
                ]
                for s in synth
            ],
        )
    )
    write(args.out, {"config": cfg, "in_process": procs, "one_process": synth})


if __name__ == "__main__":
    main()
