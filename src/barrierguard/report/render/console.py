"""Plain-text rendering of a report, for terminals and logs."""

from __future__ import annotations

import os

from barrierguard.report.records import (
    MemoryReport,
    RankSummary,
    Report,
    Site,
    Violation,
    rank_ranges,
)

__all__ = ["render"]

_ENGINE_WORDS = {
    "cuda": "cuda (CUDA sync-debug mode + intercepted calls)",
    "audit": "audit (CPU: lines that would sync on a GPU)",
    "none": "none",
}


def _short(path: str, width: int = 28) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3) :]


def _where(site: Site) -> str:
    return f"{os.path.basename(site.file)}:{site.line}"


# Phases whose syncs a guard counts apart from the training steps.
_APART = ("validate", "test", "predict", "checkpoint", "teardown", "after-loop")


def _apart(site: Site) -> str:
    parts = [f"{name} {n}" for name, n in site.phases if name in _APART]
    return ", ".join(parts)


def _row(i: int, site: Site, measured: bool) -> list[str]:
    count = site.step_count if measured else site.count - site.step_count
    per = f"{site.per_step:.2f}" if measured else "-"
    stall = f"{site.stall_s * 1e3:.2f}" if site.stall_s is not None else "-"
    kind = site.kind + (f"/{site.detail}" if site.detail else "")
    return [str(i), _where(site), kind, site.origin, str(count), per, stall, site.code]


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
    lines.append(
        f"  steps {report.steps} (warm-up {report.warmup_steps}, measured {report.measured_steps})"
        f" | syncs in measured steps {report.step_syncs} ({per:.2f} per step)"
        f" | setup syncs {setup} | {report.duration_s:.2f} s"
    )
    if report.timeline is not None and report.timeline.summary:
        lines.append(f"  timing: {report.timeline.summary}")
    gate = report.gating_site
    if report.rank_summaries:
        lines.append("")
        lines.extend(render_ranks(report.rank_summaries, gate))
    header = ["#", "where", "kind", "origin", "count", "/step", "stall ms", "code"]
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
    if report.violations:
        # One line per site: the first step it broke the policy in, and how often.
        grouped: dict[tuple[str, int, str, str], list[Violation]] = {}
        for v in report.violations:
            grouped.setdefault((v.file, v.line, v.kind, v.origin), []).append(v)
        lines.append("")
        lines.append(f"policy violations: {len(report.violations)} at {len(grouped)} site(s)")
        for (file, line, kind, origin), vs in list(grouped.items())[:20]:
            lines.append(
                f"  {os.path.basename(file)}:{line} {kind} ({origin}): {len(vs)}x from step "
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
        lines[0] += f"the gating site is {_where(gate)} ({gate.kind}, rank {fired} only)"
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
        rows.append(
            [
                str(s.rank),
                str(s.steps),
                f"{s.syncs_per_step:.2f}",
                _ms(s.stall_per_step_s),
                _ms(s.host_step_s),
                _ms(s.device_step_s),
                waits,
            ]
        )
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


def render_memory(memory: MemoryReport) -> list[str]:
    """The memory section: one line per series, then the verdict and any cause.

    Example:
        >>> m = MemoryReport(steps=(0, 1), series={"host_rss": (2_000_000, 2_000_000)})
        >>> render_memory(m)[1].split()[:2]
        ['host_rss', '2.0']
    """
    lines = [f"memory per step ({memory.sampling or f'{len(memory.steps)} samples'}):"]
    width = max((len(n) for n in memory.series), default=0)
    for name, values in memory.series.items():
        read = [v for v in values if v is not None]
        if not read:
            lines.append(f"  {name.ljust(width)}  (never read)")
            continue
        slope = memory.slopes.get(name)
        rate = f"{slope / 1e6:+,.3f} MB/step" if slope is not None else "slope -"
        state = "GROWING" if name in memory.growing else "flat"
        if name not in memory.verdict_series:
            state = "not judged"
        began = memory.growth_began_at.get(name)
        since = f" from step {began}" if began is not None and name in memory.growing else ""
        lines.append(
            f"  {name.ljust(width)}  {_mb(read[0])} -> {_mb(read[-1])}  peak "
            f"{_mb(memory.peak.get(name, max(read)))}  {rate}{since}  {state}"
        )
    verdict = "LEAK" if memory.leak else "no leak"
    lines.append(f"  verdict: {verdict} - {memory.reason}")
    if memory.pattern:
        lines.append(f"  cause ({memory.pattern}): {memory.evidence}")
        lines.append(f"  fix: {memory.fix}")
    for note in memory.notes:
        lines.append(f"  note: {note}")
    return lines
