"""When does a ``non_blocking`` copy of pageable host memory block the host?

Question:
    From what size does ``tensor.to("cuda", non_blocking=True)`` of a pageable
    (not pinned) CPU tensor wait for the GPU instead of returning at once? The
    CUDA engine reports such copies above the largest size that returned
    (``PAGEABLE_BLOCKING_BYTES``).

Design:
    For each size from 128 bytes to 8 MiB: queue a 20 ms ``torch.cuda._sleep``
    kernel (its cycle count from one long probe, the clock a 20 ms kernel runs
    at), then time the copy call on the host; the median of ``--repeats`` tries.
    A call that returns in far less than the kernel did not wait for it; one
    that takes the whole 20 ms (more than 5 ms is counted as blocking) did.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_pageable.py --out benchmarks/results/h200/pageable.json

    The committed ``h200/pageable.json`` is this script's own run at 2c45661;
    ``run_all.sh`` runs it with the rest of the suite. GPU only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, sleep_cycles_per_ms, sync, table, write

SIZES = (128, 4096, 65536, 262144, 1 << 20, 3 << 19, 2 << 20, 3 << 20, 4 << 20, 6 << 20, 8 << 20)
SLEEP_MS = 20


def pageable_sweep(repeats: int) -> dict[str, Any]:
    """Host milliseconds of each size's ``non_blocking`` copy behind a 20 ms kernel."""
    per_ms = sleep_cycles_per_ms(probe=50_000_000, samples=1)
    rows = []
    for size in SIZES:
        host = torch.empty(size // 4)
        host.to("cuda", non_blocking=True)
        samples = []
        for _ in range(repeats):
            sync()
            torch.cuda._sleep(int(SLEEP_MS * per_ms))
            t0 = time.perf_counter()
            host.to("cuda", non_blocking=True)
            samples.append((time.perf_counter() - t0) * 1e3)
            sync()
        rows.append({"bytes": size, "host_ms": median(samples), "blocks": median(samples) > 5})
    return {"sleep_ms": SLEEP_MS, "sizes": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_pageable.py times copies to a CUDA device: it needs a GPU")
    sweep = pageable_sweep(args.repeats)
    print(f"\n## host time of a non_blocking copy of pageable memory behind a {SLEEP_MS} ms kernel")
    print(
        table(
            ["bytes", "host ms", "blocks"],
            [[r["bytes"], f"{r['host_ms']:.3f}", r["blocks"]] for r in sweep["sizes"]],
        )
    )
    results = {"command": " ".join(sys.argv), "pageable_nonblocking": sweep}
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
