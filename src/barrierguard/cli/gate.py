"""The CI gate's commands: ``baseline``, ``check``, ``report``, ``diff`` and ``merge``
(the per-rank reports of a distributed run), and the formats CI reads (GitHub
annotations, SARIF, HTML) that ``run`` writes too. Exit statuses: see ``barrierguard.cli.main``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from barrierguard._errors import BarrierGuardError
from barrierguard.report.baseline import Baseline, Finding, compare, make_baseline
from barrierguard.report.records import Report
from barrierguard.report.render import html
from barrierguard.session.site_stats import ci_text

__all__ = ["CI_FORMATS", "FORMAT_HELP", "dispatch", "expand", "merge_files", "write"]

EXIT_OK = 0
EXIT_REGRESSION = 1

CI_FORMATS = ("text", "github", "sarif")
FORMAT_HELP = (
    "text (the default), github (GitHub Actions annotations, one per site, at the user's "
    "line), or sarif (a SARIF 2.1.0 log for code scanning)"
)


def write(path: str | None, text: str, what: str) -> None:
    """Write ``text`` to ``path`` (stdout without one) and say so on stderr."""
    if not path:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as err:
        raise BarrierGuardError(f"{path}: {err.strerror or err}") from err
    print(f"barrierguard: {what} written to {path}", file=sys.stderr)


def _render(report: Report, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2) + "\n"
    return html.render(report) if fmt == "html" else str(report) + "\n"


def _load(path: str) -> Report:
    """The report at ``path``, which a comparison can use (one where detection ran)."""
    report = Report.load(path)
    if not report.detection:
        raise BarrierGuardError(
            f"{path}: this report comes from a run where no detection ran (engine "
            f"{report.engine!r}); comparing it would say nothing - record the report on a "
            "CUDA machine or with the CPU audit engine"
        )
    return report


def _print_findings(findings: list[Finding], label: str) -> int:
    bad = [f for f in findings if f.fails]
    for f in findings:
        if not f.fails and f.change != "gone":
            print(f"barrierguard: info: {f.explain()}")
    for f in bad:
        print(f"barrierguard: {f.explain()}")
    if bad:
        print(f"barrierguard: {label}: {len(bad)} regression(s)", file=sys.stderr)
        return EXIT_REGRESSION
    gone = sum(f.change == "gone" for f in findings)
    note = f" ({gone} baseline site(s) gone: the baseline can be tightened)" if gone else ""
    print(f"barrierguard: {label}: ok, nothing new{note}")
    return EXIT_OK


def _baseline(ns: argparse.Namespace) -> int:
    baseline = make_baseline(_load(ns.report), root=ns.root, source=ns.report)
    baseline.save(ns.out)
    print(f"barrierguard: baseline of {len(baseline.entries)} site(s) written to {ns.out}")
    return EXIT_OK


def _check(ns: argparse.Namespace) -> int:
    baseline = Baseline.load(ns.baseline)
    report = _load(ns.report)
    findings = compare(baseline, report, root=ns.root, tolerance=ns.tolerance)
    code = _print_findings(findings, f"check of {ns.report} against {ns.baseline}")
    failed = {f.site: f.explain() for f in findings if f.fails and f.site is not None}
    messages = {site.key: text for site, text in failed.items()}
    annotated = replace(report, policy="error", sites=tuple(failed))
    if (text := ci_text(annotated, ns.format, set(messages), messages)) is not None:
        write(ns.format_out, text, f"{ns.format} output")
    return code


def _report(ns: argparse.Namespace) -> int:
    write(ns.out, _render(Report.load(ns.report), ns.format), f"{ns.format} report")
    return EXIT_OK


def _diff(ns: argparse.Namespace) -> int:
    a, b = _load(ns.a), _load(ns.b)
    findings = compare(make_baseline(a, root=ns.root), b, root=ns.root)
    for f in findings:
        if f.change == "gone":
            print(f"barrierguard: {f.explain()}")
    per_a, per_b = (r.step_syncs / r.measured_steps if r.measured_steps else 0.0 for r in (a, b))
    print(
        f"barrierguard: syncs per measured step {per_a:.2f} -> {per_b:.2f}; "
        f"sites {len(a.sites)} -> {len(b.sites)}"
    )
    return _print_findings(findings, f"diff {ns.a} -> {ns.b}")


def expand(patterns: Sequence[str]) -> list[str]:
    """The files named, each once: an argument as is, or its (quoted) glob, sorted.

    Raises:
        BarrierGuardError: For a glob that matches no file.
    """
    files: dict[str, None] = {}
    for pattern in patterns:
        if glob.has_magic(pattern) and not os.path.exists(pattern):
            if not (matches := sorted(glob.glob(pattern))):
                raise BarrierGuardError(f"{pattern}: no file matches")
            files.update(dict.fromkeys(matches))
        else:
            files[pattern] = None
    return list(files)


def merge_files(paths: Sequence[str]) -> Report:
    """The merged report of the per-rank report files ``paths`` (what ``merge`` writes); the
    ranks are those the reports record, else the order of ``paths``.

    Raises:
        BarrierGuardError: For a file that is not a report, a merged report, or two files of
            the same rank; the message names the files.
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


_COMMANDS = {
    "baseline": _baseline,
    "check": _check,
    "report": _report,
    "diff": _diff,
    "merge": _merge,
}


def dispatch(ns: argparse.Namespace) -> int:
    """Run the gate command named by ``ns.command``; return the exit status."""
    try:
        return _COMMANDS[ns.command](ns)
    except OSError as err:
        name = err.filename if err.filename is not None else "?"
        raise BarrierGuardError(f"{name}: {err.strerror or err}") from err
