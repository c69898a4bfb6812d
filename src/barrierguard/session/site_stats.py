"""One site's counters while a guard runs, and how the site reads in a report, a message or CI."""

from __future__ import annotations

import linecache
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from barrierguard.detect import frameworks
from barrierguard.detect.frames import Location
from barrierguard.detect.kinds import CODES, KINDS, code_for, fix_for
from barrierguard.report.records import Report, Site, SiteKey
from barrierguard.report.render import github, sarif

__all__ = ["SiteStats", "ci_text", "code_at", "message", "rule_table", "site_record"]


@dataclass(slots=True, eq=False)
class SiteStats:
    """Mutable counters of one site while the guard runs."""

    loc: Location
    allowed: bool
    blocking: bool
    count: int = 0
    events: int = 0
    setup_count: int = 0
    step_count: int = 0
    ranges: list[list[int]] = field(default_factory=list)
    threads: dict[str, None] = field(default_factory=dict)
    last_ident: int = 0
    stall: float = 0.0
    stall_count: int = 0
    setup_stall: float = 0.0
    phases: dict[str, int] = field(default_factory=dict)
    mechanisms: dict[str, int] = field(default_factory=dict)
    in_loop: bool = False  # whether a closed measured step saw this site (``loop_end``)


def rule_table() -> dict[str, tuple[str, str, str]]:
    """The rule codes in code order, ``code -> (kind, what it is, its fix)`` (SARIF's rules)."""
    return {
        code: (kind, KINDS[kind].what, KINDS[kind].fix)
        for kind, code in sorted(CODES.items(), key=lambda kv: kv[1])
    }


def ci_text(
    report: Report,
    fmt: str,
    failing: Collection[SiteKey] | None = None,
    messages: Mapping[SiteKey, str] | None = None,
) -> str | None:
    """``report`` as ``github`` annotations or a ``sarif`` log; None for ``text``."""
    if fmt == "text":
        return None
    if fmt == "github":
        return github.render(report, failing=failing, messages=messages)
    return sarif.render(report, rules=rule_table(), failing=failing, messages=messages)


def code_at(file: str, line: int) -> str:
    """The source text of ``file``'s ``line``, stripped."""
    return linecache.getline(file, line).strip()


def _cause(mechanisms: dict[str, int]) -> str:
    """Why a framework sync syncs: its most frequent known mechanism's reason, or ``""``."""
    known = (frameworks.mechanism(n) for n in sorted(mechanisms, key=lambda n: -mechanisms[n]))
    return next((m.why for m in known if m is not None), "")


def _fix(loc: Location, mechanisms: dict[str, int]) -> str:
    """The fix of a site: its framework mechanisms' when known, else its kind's."""
    known = frameworks.mechanism_fixes(mechanisms.items()) if mechanisms else None
    if known is not None:
        return known
    if loc.framework_file is not None and loc.origin.startswith("framework:"):
        where = f"{os.path.basename(loc.framework_file)}:{loc.framework_line}"
        return (
            f"a sync inside {loc.origin.split(':', 1)[1]} ({where}, {loc.framework_function}) "
            "that barrierguard's framework table does not know: look for a setting of that "
            f"function; if the call is yours: {fix_for(loc.kind, loc.detail)}"
        )
    return fix_for(loc.kind, loc.detail)


def message(stats: SiteStats, step: int, reason: str) -> str:
    """The text of a policy warning or error for a sync at ``stats``'s site."""
    loc = stats.loc
    code = code_for(loc.kind)
    kind = loc.kind + (f" ({loc.detail})" if loc.detail else "")
    inside = ""
    if loc.framework_file:
        inside = f" inside {os.path.basename(loc.framework_file)}:{loc.framework_line}"
    return (
        f"{code} {kind} sync at {loc.file}:{loc.line} in step {step} [{loc.origin}{inside}]: "
        f"{code_at(loc.file, loc.line)!r} - {reason}. Fix: {_fix(loc, stats.mechanisms)}. "
        f"To accept it: '# barrierguard: allow[{code}]' on the line, "
        f"allow=[{loc.kind!r}] or allow=['{os.path.basename(loc.file)}:{loc.line}']"
    )


def site_record(stats: SiteStats, measured: int) -> Site:
    """The report's record of one site, ``measured`` steps after warm-up."""
    loc = stats.loc
    return Site(
        file=loc.file,
        line=loc.line,
        function=loc.function,
        code=code_at(loc.file, loc.line),
        kind=loc.kind,
        rule=code_for(loc.kind),
        detail=loc.detail,
        origin=loc.origin,
        count=stats.count,
        setup_count=stats.setup_count,
        step_count=stats.step_count,
        per_step=stats.step_count / measured if measured else 0.0,
        steps=tuple((a, b) for a, b in stats.ranges),
        stall_s=stats.stall if stats.stall_count else None,
        stall_count=stats.stall_count,
        setup_stall_s=stats.setup_stall if stats.setup_stall else None,
        threads=tuple(stats.threads),
        allowed=stats.allowed,
        blocking=stats.blocking,
        fix=_fix(loc, stats.mechanisms),
        framework_file=loc.framework_file,
        framework_line=loc.framework_line,
        framework_function=loc.framework_function,
        phases=tuple(stats.phases.items()),
        mechanisms=tuple(stats.mechanisms.items()),
        cause=_cause(stats.mechanisms),
        events=stats.events,
    )
