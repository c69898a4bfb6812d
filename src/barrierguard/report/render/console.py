"""Plain-text rendering of a report, for terminals and logs."""

from __future__ import annotations

import os
from collections.abc import Callable

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
    "kind_of",
    "leak_word",
    "rank_cells",
    "render",
    "render_compile",
    "series_rows",
    "violation_groups",
    "violations_heading",
    "wait_share",
]

_ENGINE_WORDS = {
    "cuda": "cuda (CUDA sync-debug mode + intercepted calls)",
    "audit": "audit (CPU: lines that would sync on a GPU)",
}
# Phases whose syncs a guard counts apart from the training steps.
_APART = ("validate", "test", "predict", "checkpoint", "teardown", "after-loop", "compile", "probe")
_HEADER = ["#", "where", "rule", "kind", "origin", "count", "/step", "stall ms", "code"]
_RANK_ROWS = 16

ViolationKey = tuple[str, int, str, str]


def _short(path: str, width: int = 60) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3) :]


def _apart(site: Site) -> str:
    return ", ".join(f"{name} {n}" for name, n in site.phases if name in _APART)


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.2f}" if x is not None else "-"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def kind_of(site: Site) -> str:
    """The site's kind, with its detail: ``copy/h2d``."""
    return site.kind + (f"/{site.detail}" if site.detail else "")


def leak_word(memory: MemoryReport) -> str:
    """The memory verdict in one word: ``LEAK`` or ``no leak``."""
    return "LEAK" if memory.leak else "no leak"


def _row(i: int, site: Site, measured: bool) -> list[str]:
    count = site.step_count if measured else site.count - site.step_count
    per = f"{site.per_step:.2f}" if measured else "-"
    return [str(i), site.location, site.rule or "-", kind_of(site), site.origin, str(count), per]


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header) - 1)]
    return [
        "  " + "  ".join(r[c].ljust(w) for c, w in enumerate(widths)) + "  " + r[-1]
        for r in [header, *rows]
    ]


def _sites(sites: list[Site], measured: bool, details: Callable[[Site], list[str]]) -> list[str]:
    """The table of ``sites``, each row followed by its ``details``, indented."""
    rows = [[*_row(i, s, measured), _ms(s.stall_s), s.code] for i, s in enumerate(sites, 1)]
    table = _table(rows, _HEADER)
    lines = table[:1]
    for site, text in zip(sites, table[1:], strict=True):
        lines.append(text)
        lines.extend(f"       {d}" for d in details(site))
    return lines


def _hot_details(site: Site, world: int, gate: Site | None) -> list[str]:
    out = []
    if site.framework_file is not None:
        out.append(
            f"inside {_short(site.framework_file)}:{site.framework_line}"
            f" ({site.framework_function})"
        )
    if site.cause:
        out.append(f"why: {site.cause}")
    if site.setup_count:
        out.append(f"also {site.setup_count} in setup and warm-up")
    if apart := _apart(site):
        out.append(f"also counted apart: {apart}")
    if site.threads != ("MainThread",):
        out.append(f"thread {', '.join(site.threads)}")
    if site.stall_s is not None and site.stall_count:
        out.append(
            f"stalled {site.stall_s * 1e3:.2f} ms in all, "
            f"{site.stall_s / site.stall_count * 1e3:.3f} ms per occurrence"
        )
    if site.asymmetric:
        out.append(_asymmetry(site, world, gate))
    if compiled := site.compile_consequence:
        out.append(f"compile: {compiled}")
    out.append(f"{'allowed; ' if site.allowed else ''}fix: {site.fix}")
    return out


def _cold_details(site: Site) -> list[str]:
    out = [f"counted apart: {apart}"] if (apart := _apart(site)) else []
    if compiled := site.compile_consequence:
        out.append(f"compile: {compiled}")
    return out


def violation_groups(report: Report) -> dict[ViolationKey, list[Violation]]:
    """The violations by site (file, line, kind, origin), in the order they happened."""
    grouped: dict[ViolationKey, list[Violation]] = {}
    for v in report.violations:
        grouped.setdefault((v.file, v.line, v.kind, v.origin), []).append(v)
    return grouped


def render(report: Report) -> str:
    """Render ``report`` as the console table, sites ranked by cost."""
    engine = _ENGINE_WORDS.get(report.engine, report.engine) if report.detection else report.engine
    lines = [f"barrierguard report: engine {engine}, policy {report.policy}"]
    if not report.detection:
        lines.append("  no detection ran: nothing below says anything about synchronizations.")
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
        lines += ["", *render_ranks(report.rank_summaries, gate)]
    if report.detection and not report.sites:
        lines.append("  no synchronization found.")
    ranked = report.ranked()
    if hot := [s for s in ranked if s.step_count > 0]:
        world = len(report.rank_summaries)
        lines += ["", "in the measured steps (ranked by cost):"]
        lines += _sites(hot, True, lambda s: _hot_details(s, world, gate))
    if cold := [s for s in ranked if s.step_count == 0]:
        lines += [
            "",
            "setup, warm-up, and phases counted apart (validation, checkpoints, teardown, "
            "after the loop; never counted against the policy):",
        ]
        lines += _sites(cold, False, _cold_details)
    if report.compile is not None:
        lines += ["", *render_compile(report.compile)]
    if report.violations:
        grouped = violation_groups(report)
        rules = {s.key[:4]: s.rule for s in report.sites}
        lines += ["", f"{violations_heading(report, len(grouped))}:"]
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
        lines += ["", *render_memory(report.memory)]
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def violations_heading(report: Report, sites: int) -> str:
    """What the violations mean under the report's policy, with their numbers."""
    n = len(report.violations)
    if report.policy == "error":
        return f"policy violations: {n} at {sites} site(s)"
    what = "warned once per line" if report.policy == "warn" else "counted"
    return (
        f"not allowed (policy {report.policy}: {what}, not enforced; --policy error fails on "
        f"them): {n} at {sites} site(s)"
    )


def render_compile(section: CompileReport) -> list[str]:
    """The compile section: the verdict, the breaks that are not syncs, skips, the probe."""
    lines = [section.verdict]
    if others := [b for b in section.graph_breaks if not b.sync]:
        lines.append("  graph breaks that are not syncs:")
        for b in others:
            tag = f" [{b.gb}]" if b.gb else ""
            times = f" ({b.count}x)" if b.count > 1 else ""
            lines.append(f"    {b.location}{tag}{times}: {b.reason}")
    lines += [
        f"  CUDA graphs skipped at {skip.location}: {skip.reason}"
        for skip in section.cudagraph_skips
    ]
    if section.compile_syncs:
        lines.append(
            f"  {section.compile_syncs} syncs while compiling (tracing, inductor, autotuning), "
            "counted apart from the steps"
        )
    if (probe := section.probe) is not None:
        lines.append(f"  capture probe: {probe.status} - {probe.captured}")
        if probe.status == "blocked":
            lines.append(f"    first blocked at {probe.location}: {probe.code}")
        if probe.status == "blocked" or probe.reason:
            lines.append(f"    {probe.reason}")
    return lines + [f"  note: {note}" for note in section.notes]


def _asymmetry(site: Site, world: int, gate: Site | None) -> str:
    fired = [r for r, _ in site.rank_counts]
    text = f"rank-asymmetric: fires on rank{'s' if len(fired) > 1 else ''} "
    text += f"{rank_ranges(fired)} only (of {world})"
    if site.job_cost_s is not None:
        text += f"; every other rank waits about {site.job_cost_s * 1e3:.2f} ms per step for it"
    return text + (" [gating site]" if site is gate else "")


def rank_cells(s: RankSummary) -> list[str]:
    """A rank's row of the ranks table, but its wait: rank, steps, syncs, stall, step times."""
    times = (s.stall_per_step_s, s.host_step_s, s.device_step_s)
    return [str(s.rank), str(s.steps), f"{s.syncs_per_step:.2f}", *map(_ms, times)]


def wait_share(s: RankSummary) -> str:
    """What share of its step a rank waits, ``" (12% of its step)"``; ``""`` if unknown."""
    return f" ({s.wait_s / s.step_s:.0%} of its step)" if s.wait_s and s.step_s else ""


def render_ranks(summaries: tuple[RankSummary, ...], gate: Site | None) -> list[str]:
    """The per-rank table of a merged report, and the gating site in words."""
    head = f"ranks ({len(summaries)}): "
    if gate is None:
        head += "every site fires on every rank (no rank-asymmetric site in the steps)"
    else:
        fired = rank_ranges(r for r, _ in gate.rank_counts)
        head += f"the gating site is {gate.location} ({gate.kind}, rank {fired} only)"
        if gate.job_cost_s is not None:
            head += (
                f": the other ranks wait about {gate.job_cost_s * 1e3:.2f} ms per step at "
                "the next collective"
            )
        else:
            head += ": its cost was not timed here (the CUDA engine times it on a GPU)"
    header = ["rank", "steps", "syncs/step", "stall ms/step", "step ms host", "device", "waits"]
    rows = [
        [*rank_cells(s), "-" if s.wait_s is None else f"{s.wait_s * 1e3:.2f} ms{wait_share(s)}"]
        for s in summaries[:_RANK_ROWS]
    ]
    lines = [head, *_table(rows, header)]
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


# One memory series as the console and the HTML show it: name, first, last and peak
# bytes, slope, the step a growing series began to grow, state (first None: never read).
SeriesRow = tuple[str, float | None, float, float, float | None, int | None, str]


def series_rows(memory: MemoryReport) -> list[SeriesRow]:
    """One row per memory series; its state is ``GROWING``, ``under the limit``, or
    ``not judged`` (not a verdict series, or too few samples for any verdict)."""
    rows: list[SeriesRow] = []
    for name, values in memory.series.items():
        if not (read := [v for v in values if v is not None]):
            rows.append((name, None, 0.0, 0.0, None, None, "never read"))
            continue
        if name in memory.growing:
            state = "GROWING"
        elif name not in memory.verdict_series or memory.reason.startswith("no verdict"):
            state = "not judged"
        else:
            state = "under the limit"
        began = memory.growth_began_at.get(name) if name in memory.growing else None
        peak = memory.peak.get(name, max(read))
        rows.append((name, read[0], read[-1], peak, memory.slopes.get(name), began, state))
    return rows


def render_memory(memory: MemoryReport) -> list[str]:
    """The memory section: one line per series, then the verdict and any cause."""
    lines = [f"memory per step ({memory.sampling or f'{len(memory.steps)} samples'}):"]
    width = max((len(n) for n in memory.series), default=0)
    for name, first, last, peak, slope, began, state in series_rows(memory):
        if first is None:
            lines.append(f"  {name.ljust(width)}  (never read)")
            continue
        rate = f"{slope / 1e6:+,.3f} MB/step" if slope is not None else "slope -"
        since = f" from step {began}" if began is not None else ""
        lines.append(
            f"  {name.ljust(width)}  {_mb(first)} -> {_mb(last)}  peak "
            f"{_mb(peak)}  {rate}{since}  {state}"
        )
    lines.append(f"  verdict: {leak_word(memory)} - {memory.reason}")
    if memory.pattern:
        lines += [f"  cause ({memory.pattern}): {memory.evidence}", f"  fix: {memory.fix}"]
    return lines + [f"  note: {note}" for note in memory.notes]
