"""The CI formats of the command line: GitHub annotations and SARIF, to stdout or a file."""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping

from barrierguard._errors import BarrierGuardError
from barrierguard.report.records import Report, SiteKey
from barrierguard.session.site_stats import rule_table

__all__ = ["CI_FORMATS", "FORMAT_HELP", "emit", "write_html"]

CI_FORMATS = ("text", "github", "sarif")
FORMAT_HELP = (
    "text (the default), github (GitHub Actions annotations, one per site, at the user's "
    "line), or sarif (a SARIF 2.1.0 log for code scanning)"
)


def emit(
    report: Report,
    fmt: str,
    path: str | None = None,
    failing: Collection[SiteKey] | None = None,
    messages: Mapping[SiteKey, str] | None = None,
) -> None:
    """Write ``report`` as ``fmt`` (``github`` or ``sarif``) to ``path`` or stdout;
    ``text`` writes nothing here (the console report goes to stderr)."""
    if fmt == "text":
        return
    if fmt == "github":
        from barrierguard.report.render.github import render as render_github

        text = render_github(report, failing=failing, messages=messages)
    else:
        from barrierguard.report.render.sarif import render as render_sarif

        text = render_sarif(report, rules=rule_table(), failing=failing, messages=messages)
    if path is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as err:
        raise BarrierGuardError(f"{path}: {err.strerror or err}") from err
    print(f"barrierguard: {fmt} output written to {path}", file=sys.stderr)


def write_html(report: Report, path: str) -> None:
    """Write ``report`` as the HTML page to ``path``."""
    from barrierguard.report.render.html import render as render_html

    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(render_html(report))
    except OSError as err:
        raise BarrierGuardError(f"{path}: {err.strerror or err}") from err
    print(f"barrierguard: HTML report written to {path}", file=sys.stderr)
