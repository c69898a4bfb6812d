"""The CI gate's commands: ``baseline``, ``check``, ``report`` and ``diff``.

Exit status: 0 ok, 1 a regression (a new site, more lines of a site, more
syncs per step), 2 bad usage or a bad file (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from barrierguard._baseline import Baseline, Finding, compare, make_baseline
from barrierguard._errors import BarrierGuardError
from barrierguard._report import Report

__all__ = ["dispatch"]

EXIT_OK = 0
EXIT_REGRESSION = 1


def _memory_of(path: str, report: Report) -> Mapping[str, Any] | None:
    if getattr(report, "memory", None) is not None:
        return None  # the renderer reads it from the report itself
    # Reports of builds that record memory carry it in the JSON even when this
    # build's Report has no field for it.
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    memory = data.get("memory") if isinstance(data, Mapping) else None
    return memory if isinstance(memory, Mapping) else None


def _need_detection(report: Report, path: str) -> None:
    if not report.detection:
        raise BarrierGuardError(
            f"{path}: this report comes from a run where no detection ran (engine "
            f"{report.engine!r}); comparing it would say nothing - record the report on a "
            "CUDA machine or with the CPU audit engine"
        )


def _print_findings(findings: list[Finding], label: str) -> int:
    bad = [f for f in findings if f.fails]
    gone = [f for f in findings if not f.fails]
    for f in bad:
        print(f"barrierguard: {f.describe()}")
    if bad:
        print(f"barrierguard: {label}: {len(bad)} regression(s)", file=sys.stderr)
        return EXIT_REGRESSION
    note = f" ({len(gone)} baseline site(s) gone: the baseline can be tightened)" if gone else ""
    print(f"barrierguard: {label}: ok, nothing new{note}")
    return EXIT_OK


def _baseline(ns: argparse.Namespace) -> int:
    report = Report.load(ns.report)
    _need_detection(report, ns.report)
    baseline = make_baseline(report, root=ns.root, source=ns.report)
    baseline.save(ns.out)
    print(f"barrierguard: baseline of {len(baseline.entries)} site(s) written to {ns.out}")
    return EXIT_OK


def _check(ns: argparse.Namespace) -> int:
    baseline = Baseline.load(ns.baseline)
    report = Report.load(ns.report)
    _need_detection(report, ns.report)
    findings = compare(baseline, report, root=ns.root, tolerance=ns.tolerance)
    return _print_findings(findings, f"check of {ns.report} against {ns.baseline}")


def _report(ns: argparse.Namespace) -> int:
    report = Report.load(ns.report)
    if ns.format == "json":
        from barrierguard._render.json import render as render_json

        text = render_json(report)
    elif ns.format == "html":
        from barrierguard._render.html import render as render_html

        text = render_html(report, memory=_memory_of(ns.report, report))
    else:
        text = str(report) + "\n"
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"barrierguard: {ns.format} report written to {ns.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _diff(ns: argparse.Namespace) -> int:
    a, b = Report.load(ns.a), Report.load(ns.b)
    _need_detection(a, ns.a)
    _need_detection(b, ns.b)
    findings = compare(make_baseline(a, root=ns.root), b, root=ns.root)
    for f in findings:
        if not f.fails:
            print(f"barrierguard: {f.describe()}")
    per_a = a.step_syncs / a.measured_steps if a.measured_steps else 0.0
    per_b = b.step_syncs / b.measured_steps if b.measured_steps else 0.0
    print(
        f"barrierguard: syncs per measured step {per_a:.2f} -> {per_b:.2f}; "
        f"sites {len(a.sites)} -> {len(b.sites)}"
    )
    return _print_findings(findings, f"diff {ns.a} -> {ns.b}")


def dispatch(ns: argparse.Namespace) -> int:
    """Run the gate command named by ``ns.command``; return the exit status."""
    commands = {"baseline": _baseline, "check": _check, "report": _report, "diff": _diff}
    try:
        return commands[ns.command](ns)
    except OSError as err:
        name = err.filename if err.filename is not None else "?"
        raise BarrierGuardError(f"{name}: {err.strerror or err}") from err
