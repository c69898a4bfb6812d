"""GitHub Actions annotations: one workflow command per site in the steps, at the user's line."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping

from barrierguard.report.records import Report, Site, SiteKey

__all__ = ["annotation", "judged", "relative", "render"]


def relative(path: str, root: str | None = None) -> str:
    """``path`` relative to ``root`` (default: the current directory), with ``/``, as
    GitHub names a file of the repository; a path outside ``root`` stays absolute."""
    full = os.path.abspath(path)
    try:
        rel = os.path.relpath(full, os.path.abspath(root if root is not None else os.getcwd()))
    except ValueError:  # another drive on Windows
        rel = os.pardir
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        rel = full
    return rel.replace(os.sep, "/")


def judged(
    report: Report, failing: Collection[SiteKey] | None, messages: Mapping[SiteKey, str] | None
) -> list[tuple[Site, str, str]]:
    """``(site, level, message)`` of each site with a level, costliest first.

    ``"error"`` fails the error policy, ``"warning"`` is another site in the steps,
    ``"note"`` an allowed one; setup has none. ``failing`` defaults to the sites a
    violation names, ``messages`` to the sites' own.
    """
    if failing is None:
        broke = {(v.file, v.line, v.kind, v.origin) for v in report.violations}
        failing = {s.key for s in report.sites if s.key[:4] in broke}
    out = []
    for site in report.ranked():
        if site.key in failing:
            level = "error" if report.policy == "error" else "warning"
        elif site.step_count:
            level = "note" if site.allowed else "warning"
        else:
            continue
        out.append((site, level, (messages or {}).get(site.key) or message_of(site)))
    return out


def _escape(text: str, prop: bool = True) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def annotation(level: str, file: str, line: int, title: str, message: str) -> str:
    """One workflow command, escaped as GitHub reads it.

    Example:
        >>> annotation("error", "train.py", 7, "BG101 item", "loss.item(): 1 per step")
        '::error file=train.py,line=7,title=BG101 item::loss.item(): 1 per step'
    """
    return (
        f"::{level} file={_escape(file)},line={line},"
        f"title={_escape(title)}::{_escape(message, prop=False)}"
    )


def message_of(site: Site) -> str:
    """What an annotation or a SARIF result says about ``site``."""
    kind = site.kind + (f" ({site.detail})" if site.detail else "")
    framework = site.origin.split(":", 1)[1] if site.origin.startswith("framework:") else ""
    where = f" inside {framework}" if framework else ""
    count = (
        f"{site.step_count} in the measured steps ({site.per_step:.2f} per step)"
        if site.step_count
        else f"{site.count} before the measured steps"
    )
    code = f" `{site.code}`" if site.code else ""
    return f"{kind} sync{where}:{code} {count}. Fix: {site.fix}"


def render(
    report: Report,
    root: str | None = None,
    failing: Collection[SiteKey] | None = None,
    messages: Mapping[SiteKey, str] | None = None,
) -> str:
    """The annotations of ``report``'s sites, one line each, costliest first; paths
    relative to ``root``, ``failing`` and ``messages`` as for :func:`judged`."""
    lines = []
    for site, level, text in judged(report, failing, messages):
        title = f"barrierguard {site.rule or ''} {site.kind}".replace("  ", " ")
        if level != "note":
            lines.append(annotation(level, relative(site.file, root), site.line, title, text))
    return "".join(f"{line}\n" for line in lines)
