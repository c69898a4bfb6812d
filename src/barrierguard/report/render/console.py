"""Plain-text rendering of a report, for terminals and logs."""

from __future__ import annotations

import os
from typing import NamedTuple

from barrierguard.report.records import (
    CompileReport,
    MemoryReport,
    RankSummary,
    Report,
    Site,
    Violation,
    rank_ranges,
)

__all__ = [
    "SeriesRow",
    "memory_state",
    "rank_cells",
    "render",
    "render_compile",
    "series_rows",
    "violations_heading",
]

_ENGINE_WORDS = {
    "cuda": "cuda (CUDA sync-debug mode + intercepted calls)",
    "audit": "audit (CPU: lines that would sync on a GPU)",
    "none": "none",
}


def _short(path: str, width: int = 28) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3) :]


# Phases whose syncs a guard counts apart from the training steps.
_APART = ("validate", "test", "predict", "checkpoint", "teardown", "after-loop", "compile", "probe")


def _apart(site: Site) -> str:
    parts = [f"{name} {n}" for name, n in site.phases if name in _APART]
    return ", ".join(parts)


def _row(i: int, site: Site, measured: bool) -> list[str]:
    count = site.step_count if measured else site.count - site.step_count
    per = f"{site.per_step:.2f}" if measured else "-"
    stall = f"{site.stall_s * 1e3:.2f}" if site.stall_s is not None else "-"
    kind = site.kind + (f"/{site.detail}" if site.detail else "")
    rule = site.rule or "-"
    return [str(i), site.location, rule, kind, site.origin, str(count), per, stall, site.code]


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header) - 1)]
    out = []
    for r in [header, *rows]:
        cells = [r[c].ljust(widths[c]) for c in range(len(widths))]
        out.append("  " + "  ".join(cells) + "  " + r[-1])
    return out


def render(report: Report) -> str:
    """Render ``report`` as the console table, sites ranked by cost.

    Example:
        >>> from barrierguard import Report
        >>> print(render(Report(engine="none", detection=False, policy="record")))
        ... # doctest: +ELLIPSIS
        barrierguard report: engine none, policy record
        ...
    """
    lines = [f"barrierguard report: engine {report.engine}, policy {report.policy}"]
    if not report.detection:
        lines.append("  no detection ran: nothing below says anything about synchronizations.")
    else:
        lines[0] = (
            f"barrierguard report: engine {_ENGINE_WORDS.get(report.engine, report.engine)}, "
            f"policy {report.policy}"
        )
    per = report.step_syncs / report.measured_steps if report.measured_steps else 0.0
    setup = sum(s.setup_count for s in report.sites if s.blocking)
    shared = sum(s.setup_count for s in report.sites if s.blocking and s.step_count)
    also = f" ({shared} at lines also in the steps)" if shared else ""
    lines.append(
        f"  steps {report.steps} (warm-up {report.warmup_steps}, measured {report.measured_steps})"
        f" | syncs in measured steps {report.step_syncs} ({per:.2f} per step)"
        f" | setup syncs {setup}{also} | {report.duration_s:.2f} s"
    )
    if report.timeline is not None and report.timeline.summary:
        lines.append(f"  timing: {report.timeline.summary}")
    gate = report.gating_site
    if report.rank_summaries:
        lines.append("")
        lines.extend(render_ranks(report.rank_summaries, gate))
    header = ["#", "where", "rule", "kind", "origin", "count", "/step", "stall ms", "code"]
    ranked = report.ranked()
    hot = [s for s in ranked if s.step_count > 0]
    cold = [s for s in ranked if s.step_count == 0]
    if report.detection and not report.sites:
        lines.append("  no synchronization found.")
    if hot:
        lines.append("")
        lines.append("in the measured steps (ranked by cost):")
        rows = [_row(i, s, True) for i, s in enumerate(hot, 1)]
        table = _table(rows, header)
        lines.append(table[0])
        for site, text in zip(hot, table[1:], strict=True):
            lines.append(text)
            if site.framework_file is not None:
                lines.append(
                    f"       inside {_short(site.framework_file, 60)}:{site.framework_line}"
                    f" ({site.framework_function})"
                )
            if site.cause:
                lines.append(f"       why: {site.cause}")
            if site.setup_count:
                lines.append(f"       also {site.setup_count} in setup and warm-up")
            if _apart(site):
                lines.append(f"       also counted apart: {_apart(site)}")
            if site.threads != ("MainThread",):
                lines.append(f"       thread {', '.join(site.threads)}")
            if site.stall_s is not None and site.stall_count:
                lines.append(
                    f"       stalled {site.stall_s * 1e3:.2f} ms in all, "
                    f"{site.stall_s / site.stall_count * 1e3:.3f} ms per occurrence"
                )
            if site.asymmetric:
                lines.append(f"       {_asymmetry(site, len(report.rank_summaries), gate)}")
            if compiled := site.compile_consequence:
                lines.append(f"       compile: {compiled}")
            tag = "allowed; " if site.allowed else ""
            lines.append(f"       {tag}fix: {site.fix}")
    if cold:
        lines.append("")
        lines.append(
            "setup, warm-up, and phases counted apart (validation, checkpoints, teardown, "
            "after the loop; never counted against the policy):"
        )
        rows = [_row(i, s, False) for i, s in enumerate(cold, 1)]
        table = _table(rows, header)
        lines.append(table[0])
        for site, text in zip(cold, table[1:], strict=True):
            lines.append(text)
            if _apart(site):
                lines.append(f"       counted apart: {_apart(site)}")
            if compiled := site.compile_consequence:
                lines.append(f"       compile: {compiled}")
    if report.compile is not None:
        lines.append("")
        lines.extend(render_compile(report.compile))
    if report.violations:
        # One line per site: the first step it broke the policy in, and how often.
        grouped: dict[tuple[str, int, str, str], list[Violation]] = {}
        for v in report.violations:
            grouped.setdefault((v.file, v.line, v.kind, v.origin), []).append(v)
        rules = {(s.file, s.line, s.kind, s.origin): s.rule for s in report.sites}
        lines.append("")
        lines.append(f"{violations_heading(report, len(grouped))}:")
        for key, vs in list(grouped.items())[:20]:
            file, line, kind, origin = key
            rule = f"{rules[key]} " if rules.get(key) else ""
            lines.append(
                f"  {os.path.basename(file)}:{line} {rule}{kind} ({origin}): {len(vs)}x from step "
                f"{vs[0].step}: {vs[0].reason}"
            )
        if len(grouped) > 20:
            lines.append(f"  ... and {len(grouped) - 20} more sites")
    if report.memory is not None:
        lines.append("")
        lines.extend(render_memory(report.memory))
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def violations_heading(report: Report, sites: int) -> str:
    """What the violations mean under the report's policy, with their numbers.

    Example:
        >>> from barrierguard import Report
        >>> violations_heading(Report("audit", True, "error"), 2)
        'policy violations: 0 at 2 site(s)'
        >>> violations_heading(Report("audit", True, "record"), 2)
        'not allowed (policy record: counted, not enforced; --policy error fails on them): 0 at 2 site(s)'
    """
    n = len(report.violations)
    if report.policy == "error":
        return f"policy violations: {n} at {sites} site(s)"
    what = "warned once per line" if report.policy == "warn" else "counted"
    return (
        f"not allowed (policy {report.policy}: {what}, not enforced; --policy error fails on "
        f"them): {n} at {sites} site(s)"
    )


def render_compile(section: CompileReport) -> list[str]:
    """The compile section: the verdict, the breaks that are not syncs, skips, the probe.

    Example:
        >>> render_compile(CompileReport())[0]
        'compile: no graph break in the watched code; capture probe not run'
    """
    lines = [section.verdict]
    others = [b for b in section.graph_breaks if not b.sync]
    if others:
        lines.append("  graph breaks that are not syncs:")
        for b in others:
            tag = f" [{b.gb}]" if b.gb else ""
            times = f" ({b.count}x)" if b.count > 1 else ""
            lines.append(f"    {b.location}{tag}{times}: {b.reason}")
    for skip in section.cudagraph_skips:
        lines.append(f"  CUDA graphs skipped at {skip.location}: {skip.reason}")
    if section.compile_syncs:
        lines.append(
            f"  {section.compile_syncs} syncs while compiling (tracing, inductor, autotuning), "
            "counted apart from the steps"
        )
    probe = section.probe
    if probe is not None:
        lines.append(f"  capture probe: {probe.status} - {probe.captured}")
        if probe.status == "blocked":
            lines.append(f"    first blocked at {probe.location}: {probe.code}")
            lines.append(f"    {probe.reason}")
        elif probe.reason:
            lines.append(f"    {probe.reason}")
    for note in section.notes:
        lines.append(f"  note: {note}")
    return lines


def _asymmetry(site: Site, world: int, gate: Site | None) -> str:
    fired = [r for r, _ in site.rank_counts]
    text = f"rank-asymmetric: fires on rank{'s' if len(fired) > 1 else ''} "
    text += f"{rank_ranges(fired)} only (of {world})"
    if site.job_cost_s is not None:
        text += f"; every other rank waits about {site.job_cost_s * 1e3:.2f} ms per step for it"
    if site is gate:
        text += " [gating site]"
    return text


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.2f}" if x is not None else "-"


def rank_cells(s: RankSummary) -> list[str]:
    """A rank's row of the ranks table, but its wait: rank, steps, syncs, stall, step times."""
    return [
        str(s.rank),
        str(s.steps),
        f"{s.syncs_per_step:.2f}",
        _ms(s.stall_per_step_s),
        _ms(s.host_step_s),
        _ms(s.device_step_s),
    ]


_RANK_ROWS = 16


def render_ranks(summaries: tuple[RankSummary, ...], gate: Site | None) -> list[str]:
    """The per-rank table of a merged report, and the gating site in words.

    Example:
        >>> s = (RankSummary(0, 4, 4, 4, 0.004, 0.010), RankSummary(1, 4, 4, 0, None, 0.010))
        >>> render_ranks(s, None)[0]
        'ranks (2): every site fires on every rank (no rank-asymmetric site in the steps)'
    """
    lines = [f"ranks ({len(summaries)}): "]
    if gate is None:
        lines[0] += "every site fires on every rank (no rank-asymmetric site in the steps)"
    else:
        fired = rank_ranges(r for r, _ in gate.rank_counts)
        lines[0] += f"the gating site is {gate.location} ({gate.kind}, rank {fired} only)"
        if gate.job_cost_s is not None:
            lines[0] += (
                f": the other ranks wait about {gate.job_cost_s * 1e3:.2f} ms per step at "
                "the next collective"
            )
        else:
            lines[0] += ": its cost was not timed here (the CUDA engine times it on a GPU)"
    header = ["rank", "steps", "syncs/step", "stall ms/step", "step ms host", "device", "waits"]
    rows = []
    for s in summaries[:_RANK_ROWS]:
        waits = "-"
        if s.wait_s is not None:
            waits = f"{s.wait_s * 1e3:.2f} ms"
            if s.wait_s and s.step_s:
                waits += f" ({s.wait_s / s.step_s:.0%} of its step)"
        rows.append([*rank_cells(s), waits])
    lines.extend(_table(rows, header))
    if len(summaries) > _RANK_ROWS:
        lines.append(
            f"  ... and {len(summaries) - _RANK_ROWS} more ranks (rank_summaries in the JSON)"
        )
    steps = sorted(s.step_s for s in summaries if s.step_s is not None)
    if len(steps) > 1:
        lines.append(
            f"  median step per rank (the longer of host and device): {steps[0] * 1e3:.2f} ms "
            f"(fastest) to {steps[-1] * 1e3:.2f} ms (slowest)"
        )
    return lines


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class SeriesRow(NamedTuple):
    """One memory series as the console and the HTML show it (``first`` None: never read)."""

    name: str
    first: float | None
    last: float
    peak: float
    slope: float | None
    began: int | None
    state: str


def series_rows(memory: MemoryReport) -> list[SeriesRow]:
    """One row per memory series: first, last and peak bytes, slope, the step growth
    began (for a growing series) and its state.

    Example:
        >>> m = MemoryReport(steps=(0, 1), series={"host_rss": (2, 3)})
        >>> series_rows(m)[0][:4]
        ('host_rss', 2, 3, 3)
    """
    rows = []
    for name, values in memory.series.items():
        read = [v for v in values if v is not None]
        if not read:
            rows.append(SeriesRow(name, None, 0.0, 0.0, None, None, "never read"))
            continue
        began = memory.growth_began_at.get(name) if name in memory.growing else None
        rows.append(
            SeriesRow(
                name,
                read[0],
                read[-1],
                memory.peak.get(name, max(read)),
                memory.slopes.get(name),
                began,
                memory_state(memory, name),
            )
        )
    return rows


def memory_state(memory: MemoryReport, name: str) -> str:
    """What the verdict says of series ``name``: ``GROWING``, ``under the limit`` or
    ``not judged`` (not a verdict series, or too few samples for any verdict).

    Example:
        >>> m = MemoryReport(series={"host_rss": (1, 2)}, verdict_series=("host_rss",),
        ...                  reason="no verdict: 2 samples after warm-up, 9 needed")
        >>> memory_state(m, "host_rss")
        'not judged'
    """
    if name in memory.growing:
        return "GROWING"
    if name not in memory.verdict_series or memory.reason.startswith("no verdict"):
        return "not judged"
    return "under the limit"


def render_memory(memory: MemoryReport) -> list[str]:
    """The memory section: one line per series, then the verdict and any cause.

    Example:
        >>> m = MemoryReport(steps=(0, 1), series={"host_rss": (2_000_000, 2_000_000)})
        >>> render_memory(m)[1].split()[:2]
        ['host_rss', '2.0']
    """
    lines = [f"memory per step ({memory.sampling or f'{len(memory.steps)} samples'}):"]
    width = max((len(n) for n in memory.series), default=0)
    for row in series_rows(memory):
        if row.first is None:
            lines.append(f"  {row.name.ljust(width)}  (never read)")
            continue
        rate = f"{row.slope / 1e6:+,.3f} MB/step" if row.slope is not None else "slope -"
        since = f" from step {row.began}" if row.began is not None else ""
        lines.append(
            f"  {row.name.ljust(width)}  {_mb(row.first)} -> {_mb(row.last)}  peak "
            f"{_mb(row.peak)}  {rate}{since}  {row.state}"
        )
    verdict = "LEAK" if memory.leak else "no leak"
    lines.append(f"  verdict: {verdict} - {memory.reason}")
    if memory.pattern:
        lines.append(f"  cause ({memory.pattern}): {memory.evidence}")
        lines.append(f"  fix: {memory.fix}")
    for note in memory.notes:
        lines.append(f"  note: {note}")
    return lines
