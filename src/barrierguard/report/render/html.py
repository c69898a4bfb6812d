"""HTML rendering of a report: one self-contained page, no network.

Its style and sorting script (``html.css`` and ``html.js`` beside this module) are
inlined; ``#sort=COLUMN`` (``#sort=-COLUMN``: descending) sorts the sites on load.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path

from barrierguard.report.records import MemoryReport, RankSummary, Report, Site, rank_ranges
from barrierguard.report.render import console
from barrierguard.report.render.memory_chart import render_svg

__all__ = ["render"]

# The syncs chart: width, height, and the padding above, right of and below the plot.
_W, _H, _TOP, _RIGHT, _BOTTOM = 520, 180, 10, 10, 30

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("rank", "#", "num"),
    ("where", "where", "text"),
    ("function", "function", "text"),
    ("kind", "kind", "text"),
    ("origin", "origin", "text"),
    ("count", "count", "num"),
    ("step_count", "in steps", "num"),
    ("per_step", "per step", "num"),
    ("stall", "stall ms", "num"),
    ("code", "code and fix", "text"),
)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt_num(x: float) -> str:
    return str(int(x)) if x == int(x) and abs(x) < 1e15 else f"{x:.3g}"


def _nice_max(x: float) -> float:
    if x <= 0:
        return 1.0
    exp = math.floor(math.log10(x))
    return float(next(m * 10**exp for m in (1, 2, 2.5, 5, 10) if m * 10**exp >= x))


@cache
def _asset(name: str) -> str:
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


def _syncs_chart(per_step: Sequence[int], warmup: int) -> str:
    if not per_step:
        return '<div class="empty" id="no-syncs-chart">no per-step series in this report</div>'
    left, bottom = 44, _H - _BOTTOM
    pw, ph = _W - left - _RIGHT, bottom - _TOP
    ymax = _nice_max(float(max(per_step)))
    bw = pw / len(per_step)
    parts = [
        f'<svg id="syncs-chart" xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" role="img" aria-label="blocking syncs per step">'
    ]
    for i, n in enumerate(per_step):
        bh = ph * n / ymax
        color = "#9ca3af" if i <= warmup else "#2563eb"
        label = "setup (before step 1)" if i == 0 else f"step {i}"
        parts.append(
            f'<rect class="bar" x="{left + i * bw:.2f}" y="{_TOP + ph - bh:.2f}" '
            f'width="{max(bw - 0.6, 0.6):.2f}" height="{bh:.2f}" fill="{color}" data-step="{i}" '
            f'data-syncs="{n}"><title>{_e(label)}: {n} syncs</title></rect>'
        )
    parts.append(
        f'<line x1="{left}" y1="{bottom}" x2="{_W - _RIGHT}" y2="{bottom}" stroke="#9ca3af"/>'
        f'<line x1="{left}" y1="{_TOP}" x2="{left}" y2="{bottom}" stroke="#9ca3af"/>'
        f'<text x="{left - 4}" y="{_TOP + 8}" text-anchor="end">{_fmt_num(ymax)}</text>'
        f'<text x="{left - 4}" y="{bottom}" text-anchor="end">0</text>'
        f'<text x="{_W - _RIGHT}" y="{bottom + 13}" text-anchor="end">step {len(per_step) - 1}'
        f'</text><text x="{left}" y="{bottom + 13}">0</text>'
        f'<text x="{left + pw / 2:.0f}" y="{_H - 4}" text-anchor="middle">'
        "step (grey: setup and warm-up)</text></svg>"
    )
    return "".join(parts)


def _memory_chart(memory: MemoryReport | None) -> str:
    steps = memory.steps if memory is not None else ()
    # A series is drawn when it has a value per step and at least one was read.
    same = {
        name: values
        for name, values in (memory.series.items() if memory else ())
        if len(values) == len(steps) and any(v is not None for v in values)
    }
    if memory is None or not same:
        return '<div class="empty" id="no-memory">no memory samples in this report</div>'
    leak = '<div><span class="badge bad">leak suspected</span></div>' if memory.leak else ""
    return render_svg(replace(memory, series=same)) + leak


def _site_row(rank: int, site: Site, gate: Site | None) -> str:
    where = _e(site.location)
    inside = ""
    if site.framework_file:
        inside = (
            f'<div class="small">inside {_e(os.path.basename(site.framework_file))}:'
            f"{_e(site.framework_line)} ({_e(site.framework_function)})</div>"
        )
    stall = site.stall_s * 1e3 if site.stall_s is not None else None
    compiled = site.compile_consequence
    compiled = f'<div class="fix compile">compile: {_e(compiled)}</div>' if compiled else ""
    tags = ["allowed"] if site.allowed else []
    if not site.blocking:
        tags.append("not a barrier")
    if site.asymmetric:
        tags.append(f"rank-asymmetric: rank {rank_ranges(r for r, _ in site.rank_counts)} only")
    if site is gate:
        tags.append("gating site")
    if after := dict(site.phases).get("after-loop"):
        tags.append(f"after the loop: {after}")
    tag = f' <span class="small">[{_e(", ".join(tags))}]</span>' if tags else ""
    cls = ' class="allowed"' if site.allowed or not site.blocking else ""
    if site is gate:
        cls = ' class="gating"'
    return (
        f"<tr{cls}>"
        f'<td class="num" data-sort="{rank}">{rank}</td>'
        f'<td title="{_e(site.file)}" data-sort="{where}">{where}{inside}</td>'
        f"<td>{_e(site.function)}</td>"
        f'<td>{_e(console.kind_of(site))} <span class="rule">{_e(site.rule)}</span>{tag}</td>'
        f"<td>{_e(site.origin)}</td>"
        f'<td class="num" data-sort="{site.count}">{site.count}</td>'
        f'<td class="num" data-sort="{site.step_count}">{site.step_count}</td>'
        f'<td class="num" data-sort="{site.per_step:.6g}">{site.per_step:.2f}</td>'
        f'<td class="num" data-sort="{stall if stall is not None else -1:.6g}">'
        f"{f'{stall:.2f}' if stall is not None else '-'}</td>"
        f"<td><code>{_e(site.code) or '?'}</code>{compiled}"
        f'<div class="fix">fix: {_e(site.fix)}</div></td>'
        "</tr>"
    )


def _heads(labels: Sequence[str]) -> str:
    return "".join(f"<th>{_e(h)}</th>" for h in labels)


def _sites_table(report: Report) -> str:
    if not report.sites:
        text = "no synchronization found" if report.detection else "no detection ran"
        return f'<div class="empty" id="no-sites">{text}</div>'
    heads = "".join(
        f'<th data-key="{key}" data-type="{typ}" title="click to sort">{_e(label)}</th>'
        for key, label, typ in _COLUMNS
    )
    gate = report.gating_site
    rows = "".join(_site_row(i, s, gate) for i, s in enumerate(report.ranked(), 1))
    return (
        f'<table id="sites" data-sorted-by="rank:asc"><thead><tr>{heads}</tr></thead>'
        f"<tbody>{rows}</tbody></table>"
    )


def _rank_row(s: RankSummary) -> str:
    waits = "-"
    if s.wait_s is not None:
        share = console.wait_share(s).strip()
        waits = f"{s.wait_s * 1e3:.2f}" + (f' <span class="small">{share}</span>' if share else "")
    cells = "".join(f'<td class="num">{c}</td>' for c in [*console.rank_cells(s), waits])
    return f'<tr data-rank="{s.rank}">{cells}</tr>'


_RANK_HEADS = (
    "rank",
    "steps",
    "syncs per step",
    "stall ms per step",
    "median step ms (host)",
    "median step ms (device)",
    "waits ms per step for the gating site",
)


def _ranks(report: Report) -> str:
    if not report.rank_summaries:
        return ""
    gate = report.gating_site
    if gate is None:
        words = "Every site in the steps fires on every rank: no rank holds the others back."
    else:
        fired = rank_ranges(r for r, _ in gate.rank_counts)
        cost = (
            f"the other ranks wait about <b>{gate.job_cost_s * 1e3:.2f} ms per step</b> for it "
            "at the next collective"
            if gate.job_cost_s is not None
            else "its cost was not timed here (the CUDA engine times it on a GPU)"
        )
        words = (
            f"Gating site: <code>{_e(gate.location)}</code> ({_e(gate.kind)}), rank-asymmetric: "
            f"it fires on rank {_e(fired)} only; {cost}. <code>{_e(gate.code)}</code>"
        )
    rows = "".join(_rank_row(s) for s in report.rank_summaries)
    return (
        f"<h2>Ranks ({len(report.rank_summaries)})</h2>"
        f'<div class="gate" id="gating">{words}</div>'
        f'<table id="ranks"><thead><tr>{_heads(_RANK_HEADS)}</tr></thead><tbody>{rows}</tbody>'
        "</table>"
    )


def _verdict_rows(report: Report) -> list[str]:
    """One item per site that broke the policy, in the order of the sites table."""
    sites = {s.key[:4]: s for s in report.sites}
    order = {s.key[:4]: i for i, s in enumerate(report.ranked())}
    groups = console.violation_groups(report)
    rows = []
    for key in sorted(groups, key=lambda k: order.get(k, len(order))):
        file, line, kind, origin = key
        vs, site = groups[key], sites.get(key)
        rule = code = fix = ""
        if site is not None:
            kind = console.kind_of(site)
            rule = f' <span class="rule">{_e(site.rule)}</span>' if site.rule else ""
            code = f" <code>{_e(site.code)}</code>" if site.code else ""
            fix = f'<div class="fix">fix: {_e(site.fix)}</div>' if site.fix else ""
        rows.append(
            f'<li class="verdict-site"><b>{_e(os.path.basename(file))}:{line}</b> {_e(kind)}'
            f"{rule} ({_e(origin)}): {len(vs)}x from step {vs[0].step}, {_e(vs[0].reason)}"
            f"{code}{fix}</li>"
        )
    return rows


def _verdict(report: Report) -> str:
    rows = _verdict_rows(report)
    if not report.detection:
        cls, head = "none", "No detection ran: this page says nothing about synchronizations."
    elif not rows:
        hot = sum(1 for s in report.sites if s.step_count and s.blocking)
        cls = "ok"
        head = "No sync in the measured steps breaks the policy" + (
            f" ({hot} allowed site(s) in the steps)." if hot else "."
        )
    else:
        cls = "bad" if report.policy == "error" else "warn"
        head = console.violations_heading(report, len(rows)).capitalize() + ", one line per site:"
    more = f"<li>... and {len(rows) - 50} more sites</li>" if len(rows) > 50 else ""
    listed = f'<ul id="violations">{"".join(rows[:50])}{more}</ul>' if rows else ""
    mem, memory = "", report.memory
    if memory is not None and memory.reason:
        word = console.leak_word(memory)
        mem = f'<p id="memory-verdict">Memory: <b>{word}</b> - {_e(memory.reason)}</p>'
    return (
        f'<div class="verdict {cls}" id="verdict"><p id="verdict-line">{_e(head)}</p>'
        f"{listed}{mem}</div>"
    )


def _memory_section(memory: MemoryReport | None) -> str:
    if memory is None or not memory.series:
        return ""
    rows = []
    for name, first, last, peak, slope, _, state in console.series_rows(memory):
        if first is None:
            rows.append(f"<tr><td>{_e(name)}</td><td colspan=5>never read</td></tr>")
            continue
        rate = f"{slope / 1e6:+,.3f}" if slope is not None else "-"
        rows.append(
            f"<tr><td>{_e(name)}</td>"
            f'<td class="num">{first / 1e6:,.1f}</td>'
            f'<td class="num">{last / 1e6:,.1f}</td>'
            f'<td class="num">{peak / 1e6:,.1f}</td><td class="num">{rate}</td>'
            f"<td>{_e(state)}</td></tr>"
        )
    heads = _heads(("series", "first MB", "last MB", "peak MB", "MB/step", "state"))
    cause = ""
    if memory.pattern:
        cause = (
            f"<p>cause ({_e(memory.pattern)}): {_e(memory.evidence)}</p>"
            f'<p class="fix">fix: {_e(memory.fix)}</p>'
        )
    notes = "".join(f"<li>{_e(n)}</li>" for n in memory.notes)
    word = console.leak_word(memory)
    return (
        f"<h2>Memory</h2><p>verdict: <b>{word}</b> - {_e(memory.reason)}</p>{cause}"
        f'<table id="memory"><thead><tr>{heads}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
        + (f'<ul class="small">{notes}</ul>' if notes else "")
        + (f'<div class="small">sampling: {_e(memory.sampling)}</div>' if memory.sampling else "")
    )


def _badge(report: Report) -> str:
    if not report.detection:
        return '<span class="badge none" id="status">no detection</span>'
    if report.ok:
        return '<span class="badge ok" id="status">policy kept</span>'
    n = len(console.violation_groups(report))
    sites = f"{n} site{'s' if n != 1 else ''}"
    if report.policy == "error":
        return f'<span class="badge bad" id="status">fails at {sites}</span>'
    return f'<span class="badge warn" id="status">{sites} not allowed</span>'


def _compile(report: Report) -> str:
    section = report.compile
    if section is None:
        return ""
    items = "".join(
        f"<li>{_e(b.location)}{f' [{_e(b.gb)}]' if b.gb else ''}: {_e(b.reason)}</li>"
        for b in section.graph_breaks
        if not b.sync
    )
    others = f"<h3>Graph breaks that are not syncs</h3><ul>{items}</ul>" if items else ""
    skips = "".join(
        f"<li>CUDA graphs skipped at {_e(s.location)}: {_e(s.reason)}</li>"
        for s in section.cudagraph_skips
    )
    probe_text = ""
    if (probe := section.probe) is not None:
        where = f" at {_e(probe.location)} <code>{_e(probe.code)}</code>" if probe.file else ""
        probe_text = (
            f"<li>capture probe: {_e(probe.status)}{where}"
            f"{f' - {_e(probe.reason)}' if probe.reason else ''} ({_e(probe.captured)})</li>"
        )
    n = section.compile_syncs
    syncs = f"<li>{n} syncs while compiling, counted apart</li>" if n else ""
    return (
        f'<h2>Compile</h2><p id="compile-verdict">{_e(section.verdict)}</p>'
        f"<ul>{skips}{probe_text}{syncs}</ul>{others}"
    )


def render(report: Report) -> str:
    """Render ``report`` as one self-contained HTML page: the verdict (what fails the
    policy, and the memory verdict) first, then totals, sites, charts, ranks, compile."""
    per = report.step_syncs / report.measured_steps if report.measured_steps else 0.0
    setup = sum(s.setup_count for s in report.sites if s.blocking)
    cards = "".join(
        f'<div class="card"><b>{_e(v)}</b><span class="small">{_e(k)}</span></div>'
        for k, v in (
            ("steps (measured)", f"{report.steps} ({report.measured_steps})"),
            ("sites", len(report.sites)),
            ("syncs in measured steps", report.step_syncs),
            ("syncs per step", f"{per:.2f}"),
            ("setup syncs", setup),
            ("duration", f"{report.duration_s:.2f} s"),
        )
    )
    caveats = [n for n in report.notes if n.startswith("audit engine")]
    others = [n for n in report.notes if n not in caveats]
    caveat = "".join(f'<div class="caveat" id="caveat">{_e(n)}</div>' for n in caveats)
    notes = "".join(f"<li>{_e(n)}</li>" for n in others)
    env = ", ".join(f"{_e(k)} {_e(v)}" for k, v in report.environment.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>barrierguard report</title>
<style>{_asset("html.css")}</style></head>
<body>
<h1>barrierguard report {_badge(report)}</h1>
<div class="meta">engine {_e(report.engine)} &middot; policy {_e(report.policy)}
&middot; {env}</div>
{_verdict(report)}
{caveat}
<div class="cards">{cards}</div>
<h2>Sites, ranked by cost, with their fixes</h2>
{_sites_table(report)}
<h2>Per step</h2>
<div class="charts">
<div class="chart"><h3>Blocking syncs per step</h3>
{_syncs_chart(report.syncs_per_step, report.warmup_steps)}</div>
<div class="chart"><h3>Memory per step</h3>{_memory_chart(report.memory)}</div>
</div>
{_memory_section(report.memory)}
{_ranks(report)}
{_compile(report)}
{f'<h2>Notes</h2><ul id="notes">{notes}</ul>' if notes else ""}
<script>{_asset("html.js")}</script>
</body></html>
"""
