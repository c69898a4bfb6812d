"""How often does each engine give the right verdict on a line?

Question:
    On the annotated corpus, how many lines does each engine get right: every
    syncing line reported with its kind and origin, and nothing reported on a
    quiet line?

Design:
    ``tests/corpus/cases.py`` marks each line that synchronizes on a CUDA device
    with ``# expect: KIND [origin]`` and each host-only trap with ``# quiet``.
    This runs the corpus once under each engine and compares, line by line, what
    the engine reported inside the measured step with the annotation:

    * ``cuda``: the corpus on the GPU (after one warm-up pass), CUDA machines only;
    * ``audit``: the corpus on ``"cpu"`` tensors, even on a GPU machine: the audit
      reasons about CPU runs (which lines would synchronize on a GPU).

    A line agrees when the engine reported exactly the annotated (kind, origin)
    there, or nothing on a quiet line. Lines reported without an annotation are
    listed too.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_detection.py --out benchmarks/results/h200/detection.json
    PYTHONPATH=src python benchmarks/bench_detection.py --out benchmarks/results/detection_cpu.json

    The first on a GPU machine (both engines; ``bash benchmarks/run_all.sh
    benchmarks/results/h200`` runs it with the rest of the suite and keeps the
    printed table in ``detection.txt``), the second on a CPU-only one (the audit).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import table, write

import barrierguard
from corpus import cases

CORPUS = os.path.abspath(cases.__file__)


def corpus_report(engine: str) -> barrierguard.Report:
    if engine == "cuda":
        d = cases.prepare("cuda")
        cases.run_all(d)  # warm-up: lazy init, library handles, allocator
        torch.cuda.synchronize()
        with barrierguard.watch(engine="cuda", policy="record") as guard:
            guard.step()
            cases.run_all(d)
            guard.step()  # closes the measured step
        return guard.report
    # The audit follows tensors from their creation: prepare inside the guard.
    with barrierguard.watch(engine="audit", policy="record") as guard:
        d = cases.prepare("cpu")
        guard.step()
        cases.run_all(d)
        guard.step()  # closes the measured step
    return guard.report


def agreement(report: barrierguard.Report) -> dict[str, Any]:
    expected = cases.annotations()
    found: dict[int, set[tuple[str, str]]] = {}
    for site in report.sites:
        if site.file == CORPUS and site.step_count > 0:
            found.setdefault(site.line, set()).add((site.kind, site.origin))
    source = Path(CORPUS).read_text().splitlines()
    disagree: list[dict[str, Any]] = []
    quiet_flagged = 0
    for line, want in sorted(expected.items()):
        got = found.get(line, set())
        if want is None and got:
            quiet_flagged += 1
            why = f"quiet line flagged: {sorted(got)}"
        elif want is not None and got != {want}:
            why = f"expected {want}, got {sorted(got) or 'nothing'}"
        else:
            continue
        disagree.append({"line": line, "code": source[line - 1].strip(), "why": why})
    unannotated = [
        {"line": n, "code": source[n - 1].strip(), "why": f"unannotated line flagged: {sorted(g)}"}
        for n, g in sorted(found.items())
        if n not in expected
    ]
    syncing = sum(1 for w in expected.values() if w is not None)
    return {
        "annotated": len(expected),
        "syncing": syncing,
        "quiet": len(expected) - syncing,
        "agree": len(expected) - len(disagree),
        "disagree": len(disagree),
        "quiet_flagged": quiet_flagged,
        "unannotated_flagged": len(unannotated),
        "agreement": (len(expected) - len(disagree)) / len(expected),
        "disagreements": disagree + unannotated,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--engines", default="cuda,audit" if torch.cuda.is_available() else "audit")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "engines": {}}
    for engine in args.engines.split(","):
        results["engines"][engine] = agreement(corpus_report(engine))
    rows = [
        [
            name,
            r["annotated"],
            r["syncing"],
            r["quiet"],
            r["agree"],
            r["disagree"],
            r["quiet_flagged"],
            r["unannotated_flagged"],
            f"{r['agreement']:.1%}",
        ]
        for name, r in results["engines"].items()
    ]
    print("\n## per-line agreement with tests/corpus/cases.py")
    print(
        table(
            [
                "engine",
                "annotated lines",
                "syncing",
                "quiet",
                "agree",
                "disagree",
                "quiet lines flagged",
                "unannotated flagged",
                "agreement",
            ],
            rows,
        )
    )
    for name, r in results["engines"].items():
        for d in r["disagreements"]:
            print(f"  {name}: line {d['line']} `{d['code']}`: {d['why']}")
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
