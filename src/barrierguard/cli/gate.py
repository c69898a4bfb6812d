"""The CI gate's commands: ``baseline``, ``check``, ``report`` and ``diff``; and
``merge``, which joins the per-rank reports of a distributed run.

Exit status: 0 ok, 1 a regression (a new site, more lines of a site, more
syncs per step), 2 bad usage or a bad file (the message names the file).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Sequence

from barrierguard._errors import BarrierGuardError
from barrierguard.report.baseline import Baseline, Finding, compare, make_baseline
from barrierguard.report.records import Report

__all__ = ["dispatch"]

EXIT_OK = 0
EXIT_REGRESSION = 1


def _need_detection(report: Report, path: str) -> None:
    if not report.detection:
        raise BarrierGuardError(
            f"{path}: this report comes from a run where no detection ran (engine "
            f"{report.engine!r}); comparing it would say nothing - record the report on a "
            "CUDA machine or with the CPU audit engine"
        )


def _print_findings(findings: list[Finding], label: str) -> int:
    bad = [f for f in findings if f.fails]
    gone = [f for f in findings if f.change == "gone"]
    for f in findings:
        if not f.fails and f.change != "gone":
            print(f"barrierguard: info: {f.explain()}")
    for f in bad:
        print(f"barrierguard: {f.explain()}")
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
    code = _print_findings(findings, f"check of {ns.report} against {ns.baseline}")
    fmt = getattr(ns, "format", "text")
    if fmt != "text":
        from dataclasses import replace

        from barrierguard.cli.output import emit

        # Only the regressions are annotated, each with what the check says of it.
        failed = [f for f in findings if f.fails and f.site is not None]
        messages = {f.site.key: f.explain() for f in failed if f.site is not None}
        sites = tuple({f.site.key: f.site for f in failed if f.site is not None}.values())
        emit(
            replace(report, policy="error", sites=sites),
            fmt,
            getattr(ns, "format_out", None),
            failing=set(messages),
            messages=messages,
        )
    return code


def _render(report: Report, fmt: str) -> str:
    if fmt == "json":
        from barrierguard.report.render.json import render as render_json

        return render_json(report)
    if fmt == "html":
        from barrierguard.report.render.html import render as render_html

        return render_html(report)
    return str(report) + "\n"


def _report(ns: argparse.Namespace) -> int:
    report = Report.load(ns.report)
    text = _render(report, ns.format)
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
        if f.change == "gone":
            print(f"barrierguard: {f.explain()}")
    per_a = a.step_syncs / a.measured_steps if a.measured_steps else 0.0
    per_b = b.step_syncs / b.measured_steps if b.measured_steps else 0.0
    print(
        f"barrierguard: syncs per measured step {per_a:.2f} -> {per_b:.2f}; "
        f"sites {len(a.sites)} -> {len(b.sites)}"
    )
    return _print_findings(findings, f"diff {ns.a} -> {ns.b}")


def expand(patterns: Sequence[str]) -> list[str]:
    """The files named: each argument as is, or its glob (quoted on the command line),
    sorted; each file once.

    Raises:
        BarrierGuardError: For a glob that matches no file.
    """
    files: dict[str, None] = {}
    for pattern in patterns:
        if glob.has_magic(pattern) and not os.path.exists(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise BarrierGuardError(f"{pattern}: no file matches")
            files.update(dict.fromkeys(matches))
        else:
            files[pattern] = None
    return list(files)


def merge_files(paths: Sequence[str]) -> Report:
    """The merged report of the per-rank report files ``paths`` (what ``merge`` writes).

    Ranks come from the ``rank`` each report records (files of earlier
    releases record none: then the order of ``paths`` gives the ranks).

    Raises:
        BarrierGuardError: For a file that is not a report, a report that is
            already merged, or two files of the same rank; the message names
            the files.
    """
    reports = []
    seen: dict[int, str] = {}
    for path in paths:
        report = Report.load(path)
        if report.ranks:
            raise BarrierGuardError(
                f"{path}: already a merged report ({len(report.ranks)} ranks); merge the "
                "per-rank files it was made of"
            )
        if report.rank is not None:
            if report.rank in seen:
                raise BarrierGuardError(
                    f"{seen[report.rank]} and {path} both hold rank {report.rank}: are they "
                    "from two runs?"
                )
            seen[report.rank] = path
        reports.append(report)
    return Report.merge(reports)


def _merge(ns: argparse.Namespace) -> int:
    paths = expand(ns.reports)
    merged = merge_files(paths)
    if len(merged.ranks) > 1 and any(r.rank is None for r in merged.ranks):
        print(
            "barrierguard: some reports record no rank; ranks follow the order of the files",
            file=sys.stderr,
        )
    if ns.out:
        merged.save(ns.out)
        print(f"barrierguard: {len(paths)} rank report(s) merged into {ns.out}", file=sys.stderr)
    sys.stdout.write(_render(merged, ns.format))
    return EXIT_OK


def dispatch(ns: argparse.Namespace) -> int:
    """Run the gate command named by ``ns.command``; return the exit status."""
    commands = {
        "baseline": _baseline,
        "check": _check,
        "report": _report,
        "diff": _diff,
        "merge": _merge,
    }
    try:
        return commands[ns.command](ns)
    except OSError as err:
        name = err.filename if err.filename is not None else "?"
        raise BarrierGuardError(f"{name}: {err.strerror or err}") from err
