"""The audit engine on CPU against the corpus's annotations (the H200's verdicts).

The corpus lines are annotated with what the CUDA engine reports on a GPU; the
audit, run on CPU, must give the same verdict on at least 95% of them, and must
never flag a line annotated ``# quiet``. The lines it cannot judge on CPU are
listed here, with the reason, and in docs/audit.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import barrierguard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from corpus import cases

CORPUS = os.path.abspath(cases.__file__)

# Lines the audit cannot reach on CPU: the case needs a CUDA stream or event.
CUDA_ONLY = {
    "torch.cuda.current_stream().synchronize()  # expect: synchronize",
    'd["event"].synchronize()  # expect: synchronize',
}


def _audit_report() -> barrierguard.Report:
    # The audit follows tensors from their creation: prepare inside the guard
    # (setup, before the first step), like `barrierguard run` does for a script.
    with barrierguard.watch(engine="audit", policy="record") as guard:
        d = cases.prepare("cpu")
        guard.step()
        cases.run_all(d)
        guard.step()  # closes the measured step
    return guard.report


def _verdicts(
    report: barrierguard.Report,
) -> tuple[dict[int, tuple[str, str] | None], dict[int, set[tuple[str, str]]]]:
    found: dict[int, set[tuple[str, str]]] = {}
    for site in report.sites:
        if site.file == CORPUS and site.step_count > 0:
            found.setdefault(site.line, set()).add((site.kind, site.origin))
    return cases.annotations(), found


def _disagreements(
    expected: dict[int, tuple[str, str] | None], found: dict[int, set[tuple[str, str]]]
) -> dict[int, str]:
    out: dict[int, str] = {}
    for line, want in expected.items():
        got = found.get(line, set())
        if want is None and got:
            out[line] = f"quiet line flagged: {sorted(got)}"
        elif want is not None and got != {want}:
            out[line] = f"expected {want}, got {sorted(got) or 'nothing'}"
    for line, got in found.items():
        if line not in expected:
            out[line] = f"unannotated line flagged: {sorted(got)}"
    return out


def test_audit_agrees_with_the_gpu_on_95_percent_of_lines() -> None:
    report = _audit_report()
    assert report.engine == "audit" and report.detection
    expected, found = _verdicts(report)
    wrong = _disagreements(expected, found)
    lines = Path(CORPUS).read_text().splitlines()
    unexplained = {n: why for n, why in wrong.items() if lines[n - 1].strip() not in CUDA_ONLY}
    agreement = 1 - len(wrong) / len(expected)
    print(f"agreement {agreement:.1%} on {len(expected)} annotated lines")
    for n, why in sorted(wrong.items()):
        print(f"  line {n}: {lines[n - 1].strip()!r}: {why}")
    assert not unexplained, unexplained
    assert agreement >= 0.95


def test_no_host_only_line_is_flagged() -> None:
    expected, found = _verdicts(_audit_report())
    quiet = {line for line, want in expected.items() if want is None}
    assert len(quiet) >= 38
    assert not {line: found[line] for line in quiet if line in found}


def test_kinds_cover_the_vocabulary() -> None:
    _, found = _verdicts(_audit_report())
    kinds = {kind for got in found.values() for kind, _ in got}
    assert kinds >= {
        "item",
        "tolist",
        "copy",
        "int",
        "float",
        "print",
        "format",
        "bool",
        "nonzero",
        "index",
        "masked_select",
        "unique",
        "repeat_interleave",
        "compare",
        "synchronize",
        "async_d2h",
        "backward",
    }
