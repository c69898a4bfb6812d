"""Does this ``src/`` cost a launch-bound step less than an earlier commit's, in one process?

Question:
    A change that saves a few microseconds a step is below what two runs on two
    hosts can compare: the bare step alone moves by a fifth from host to host.
    Measured in one process, side by side, does ``watch(memory=False)`` of this
    ``src/`` cost the launch-bound step less than that of an earlier commit?

Design:
    The package of ``--old`` (a commit) is taken with ``git archive`` into a
    temporary folder and renamed ``barrierguard_old`` (the word ``barrierguard``
    in each of its ``.py`` files), then imported beside this ``src/``. Variants
    ``bare``, ``new`` (``barrierguard.watch(policy="record", memory=False)``) and
    ``old`` (the same from the old package), each guard started before its block
    and stopped after it, time blocks of ``--steps`` steps of bench_core's Adam
    step (``--layers`` Linear+ReLU of ``--width``, its batch copied with
    ``non_blocking=True``) in ``--pairs`` rotating rounds. Per pair of variants
    (new / bare, old / bare, new / old): the median of the per-round ratios with
    its 95% confidence interval (``_common.median_ci``), and the median
    difference of the training thread's CPU time a step over the block's steps.
    Only one guard is started at a time; each restores what it patched. With
    ``--read`` each step ends with ``loss.item()`` (a loop that logs its loss): one
    recorded sync a step, in the step's own function, a new frame each step. The
    guards are started again for each block, so the read's site, once 1,000
    violations are listed, counts on the quiet path of a long run.

Reproduce:
    On the GPU, with the commit to compare against::

        PYTHONPATH=src python benchmarks/bench_versions.py --old 542a72f --pin 2 \\
            --steps 200 --pairs 160 --out benchmarks/results/h200/versions.json

    The committed ``benchmarks/results/h200/versions_8343848.json`` and
    ``versions_8343848.txt`` (``src/`` at 8343848, 160 rounds), and
    ``benchmarks/results/h200/versions_0bd0649_a.json``, ``versions_0bd0649_a.txt``,
    ``benchmarks/results/h200/versions_0bd0649_b.json`` and ``versions_0bd0649_b.txt``
    (``src/`` at 0bd0649 on two hosts, 160 and 150 rounds) are this design against
    542a72f, run from a copy of this script before it was committed here: their
    files hold the three pairs' figures and printed lines, without the machine's
    record or the table, and their ``cpu_us`` also holds each block's ``start()``
    and ``stop()`` (about 3 ms a block), which this script leaves out. All three
    on an H200 with torch 2.11.0+cu130 and Python 3.12, ``--pin 2 --steps 200``.
    ``benchmarks/results/h200/versions_8274972.json`` and ``versions_8274972.txt`` are
    ``--old old.tar --pin 2 --steps 200 --pairs 160``, this script as committed, ``src/``
    at 8274972 against an archive of 7845e38 (before the boundary's settled probe).

    ``benchmarks/results/h200/versions_read_af0f9a7.json`` and ``versions_read_af0f9a7.txt``
    are ``--old old.tar --pin 2 --steps 100 --pairs 200 --read``, ``src/`` at af0f9a7 (a
    read once a step counted by its tally) against an archive of 1be3c24;
    ``benchmarks/results/h200/versions_read_eed2357.json`` and ``versions_read_eed2357.txt`` the
    same, ``src/`` at eed2357 against an archive of af0f9a7.
    ``benchmarks/results/h200/versions_read_9018504.json`` and ``versions_read_9018504.txt``, and
    without ``--read`` ``benchmarks/results/h200/versions_9018504.json`` and
    ``versions_9018504.txt`` (``--steps 100 --pairs 200``), are ``src/`` at 9018504 (Adam's
    ``torch.tensor(1.0)`` passes no wrapper) against an archive of eed2357, on one host;
    ``benchmarks/results/h200/versions_read_eeef063.json`` and ``versions_read_eeef063.txt``
    ``src/`` at eeef063 against eed2357, on another.
    ``benchmarks/results/h200/versions_read_f84a426.json`` and ``versions_read_f84a426.txt``
    are the ``--read`` command, ``src/`` at f84a426 (every boundary is ``Guard._advance``,
    which the optimizer hook now calls) against an archive of 68e2ff0;
    ``benchmarks/results/h200/versions_read_227da59.json`` and ``versions_read_227da59.txt``
    the same, ``src/`` at 227da59 (a boundary puts a carried tally's closed step aside)
    against an archive of a41c287. ``benchmarks/results/h200/versions_73a4ed1.json`` and
    ``versions_73a4ed1.txt`` are the command without ``--read`` (a step with no sync), ``src/``
    at 73a4ed1 against an archive of 68e2ff0.
    ``benchmarks/results/h200/versions_59aa2f4.json`` and ``versions_59aa2f4.txt`` (no read),
    and ``benchmarks/results/h200/versions_read_59aa2f4.json`` and ``versions_read_59aa2f4.txt``
    (``--read``), both ``--old old.tar --pin 2 --steps 100 --pairs 200`` on one host, are
    ``src/`` at 59aa2f4 (one test for a quiet boundary's work; the step timeline's period and
    memory sampling under 0.1% of the step) against an archive of e2a1478; their ``.txt`` hold
    the printed table alone. ``benchmarks/results/h200/versions_85f72aa.json`` and
    ``versions_85f72aa.txt`` are the same command without ``--read``, ``src/`` at 85f72aa
    (the optimizers' host step reads make one call fewer) against an archive of 358b8c8.
    ``benchmarks/results/h200/versions_42d5c31.json`` and ``versions_42d5c31.txt`` (no read),
    and ``benchmarks/results/h200/versions_read_42d5c31.json`` and
    ``versions_read_42d5c31.txt`` (``--read``), on one host, are ``src/`` at 42d5c31 (the step
    boundary is the optimizer hook itself and rolls the tallies inline) against an archive of
    47abf57.

    Where the working tree has no git history (a copy sent to a GPU machine), make the
    archive first and pass its path::

        git archive 7845e38 src/barrierguard > old.tar
        PYTHONPATH=src python benchmarks/bench_versions.py --old old.tar --pin 2 \
            --steps 200 --pairs 160

    CPU smoke run (audit engine; the old package from HEAD)::

        PYTHONPATH=src python benchmarks/bench_versions.py --device cpu --old HEAD \\
            --layers 1 --width 32 --steps 2 --pairs 3
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import adam_mlp_step, median, median_ci, paired_rounds, table, timed, write

import barrierguard

ROOT = Path(__file__).resolve().parents[1]
OLD = "barrierguard_old"
PAIRS = (("new", "bare"), ("old", "bare"), ("new", "old"))


def old_package(commit: str, into: Path) -> Any:
    """``src/barrierguard`` at ``commit``, renamed ``barrierguard_old`` under ``into``;
    ``commit`` may also name a ``.tar`` that ``git archive`` made of it (a copy without git)."""
    if commit.endswith(".tar") and Path(commit).is_file():
        archive = Path(commit).read_bytes()
    else:
        archive = subprocess.run(
            ["git", "archive", commit, "src/barrierguard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
    tar_path = into / "old.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        # The "data" filter where this Python has it (3.10.12 and later).
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    package = into / OLD
    (into / "src" / "barrierguard").rename(package)
    word = re.compile(r"\bbarrierguard\b")
    for path in package.rglob("*.py"):
        path.write_text(word.sub(OLD, path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module(OLD)


def compare(
    old: Any, device: str, steps: int, pairs: int, layers: int, width: int, read: bool = False
) -> dict[str, Any]:
    """The rotating rounds; the ratios and CPU differences of each pair of variants."""
    step = adam_mlp_step(device, layers, width, read)
    guards = {
        "new": barrierguard.watch(policy="record", memory=False),
        "old": old.watch(policy="record", memory=False),
    }
    cpu: dict[str, list[float]] = {}

    def run(name: str) -> float:
        guard = guards.get(name)
        if guard is not None:
            guard.start()
        try:
            c0 = time.thread_time()
            seconds = timed(lambda: [step() for _ in range(steps)])
            cpu.setdefault(name, []).append(time.thread_time() - c0)
        finally:
            if guard is not None:
                guard.stop()
        return seconds

    for _ in range(20):
        step()
    for name in guards:
        run(name)  # warm: imports, the first walks
    cpu.clear()
    rounds = paired_rounds(["bare", *guards], run, pairs)
    out: dict[str, Any] = {
        "steps": steps,
        "pairs": pairs,
        "layers": layers,
        "width": width,
        "read": read,
    }
    out["bare_ms_per_step"] = median([r["bare"] for r in rounds]) / steps * 1e3
    for a, b in PAIRS:
        ratios = [r[a] / r[b] for r in rounds]
        added = [(x - y) / steps * 1e6 for x, y in zip(cpu[a], cpu[b], strict=True)]
        out[f"{a}/{b}"] = {
            "ratio": median(ratios),
            "ci": median_ci(ratios),
            "cpu_us": median(added),
            "cpu_ci": median_ci(added),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--old", required=True, help="the commit to compare against (or a git archive .tar of it)"
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=160)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pin", type=int, help="run on this one CPU core")
    ap.add_argument(
        "--read", action="store_true", help="each step ends with loss.item(): one sync a step"
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    with tempfile.TemporaryDirectory() as tmp:
        old = old_package(args.old, Path(tmp))
        try:
            result = compare(
                old, args.device, args.steps, args.pairs, args.layers, args.width, args.read
            )
        finally:
            sys.path.remove(tmp)
            for name in [m for m in sys.modules if m == OLD or m.startswith(OLD + ".")]:
                del sys.modules[name]
    result = {"command": " ".join(sys.argv), "old": args.old, **result}
    rows = [
        [
            f"{a} / {b}",
            f"{result[f'{a}/{b}']['ratio']:.4f}",
            "{:.4f}-{:.4f}".format(*result[f"{a}/{b}"]["ci"]),
            f"{result[f'{a}/{b}']['cpu_us']:+.2f}",
            "{:+.2f} to {:+.2f}".format(*result[f"{a}/{b}"]["cpu_ci"]),
        ]
        for a, b in PAIRS
    ]
    read = ", each step ending with loss.item()" if args.read else ""
    print(
        f"\n## watch(memory=False){read}: this src/ (new) against {args.old} (old), "
        f"{args.pairs} rounds of {args.steps} steps, bare {result['bare_ms_per_step']:.3f} ms"
    )
    header = ["pair", "ratio (median)", "95% CI", "thread CPU us a step", "95% CI"]
    print(table(header, rows))
    write(args.out, {"benchmark": "versions", **result})
    return result


if __name__ == "__main__":
    main()
