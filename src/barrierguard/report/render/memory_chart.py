"""Memory per step as a self-contained SVG picture: one panel per series."""

from __future__ import annotations

from html import escape

from barrierguard.report.records import MemoryReport, format_bytes

__all__ = ["render_svg"]

_WIDTH, _PANEL, _LEFT, _RIGHT, _TOP, _GAP = 720, 130, 86, 16, 34, 22
_COLORS = {
    "host_rss": "#1f77b4",
    "workers_rss": "#9467bd",
    "device_allocated": "#d62728",
    "device_reserved": "#ff7f0e",
    "device_used": "#2ca02c",
}


def _panel(memory: MemoryReport, name: str, top: float) -> list[str]:
    pts = [(s, v) for s, v in zip(memory.steps, memory.series[name], strict=False) if v is not None]
    height = _PANEL - _GAP
    plot_w = _WIDTH - _LEFT - _RIGHT
    growing = name in memory.growing
    slope = memory.slopes.get(name)
    title = name + (f"  last {format_bytes(pts[-1][1])}" if pts else "")
    title += f"  {slope / 1e6:+,.3f} MB/step" if slope is not None else ""
    title += "  GROWING" if growing else ""
    out = [
        f'<text x="{_LEFT}" y="{top - 6:.1f}" font-size="12" fill="#222">{escape(title)}</text>',
        f'<rect x="{_LEFT}" y="{top:.1f}" width="{plot_w}" height="{height}" '
        'fill="#fafafa" stroke="#ccc"/>',
    ]
    if not pts:
        out.append(
            f'<text x="{_LEFT + 8}" y="{top + height / 2:.1f}" font-size="11" '
            'fill="#888">never read</text>'
        )
        return out
    x0, x1 = memory.steps[0], max(memory.steps[-1], memory.steps[0] + 1)
    lo, hi = float(min(v for _, v in pts)), float(max(v for _, v in pts))
    if hi - lo < 1e6:  # a flat series gets at least a 1 MB range, centred
        mid = (hi + lo) / 2
        lo, hi = mid - 5e5, mid + 5e5
    pad = (hi - lo) * 0.08
    lo, hi = lo - pad, hi + pad

    def px(step: float) -> float:
        return _LEFT + (step - x0) / (x1 - x0) * plot_w

    def py(value: float) -> float:
        return top + height - (value - lo) / (hi - lo) * height

    out += [
        f'<text x="{_LEFT - 6}" y="{py(value) + 4:.1f}" font-size="10" fill="#555" '
        f'text-anchor="end">{escape(f"{value / 1e6:,.1f} MB")}</text>'
        for value in (hi - pad, lo + pad)
    ]
    began = memory.growth_began_at.get(name)
    if growing and began is not None:
        out += [
            f'<line x1="{px(began):.1f}" y1="{top:.1f}" x2="{px(began):.1f}" '
            f'y2="{top + height:.1f}" stroke="#d62728" stroke-dasharray="4 3"/>',
            f'<text x="{px(began) + 4:.1f}" y="{top + 12:.1f}" font-size="10" '
            f'fill="#d62728">growth from step {began}</text>',
        ]
    color = _COLORS.get(name, "#333")
    path = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
    out.append(
        f'<polyline class="series" data-series="{escape(name)}" fill="none" stroke="{color}" '
        f'stroke-width="1.6" points="{path}"><title>{escape(name)}</title></polyline>'
    )
    return out


def render_svg(memory: MemoryReport) -> str:
    """The picture of memory per step, as a standalone SVG document.

    Args:
        memory: The report's memory section.

    Example:
        >>> m = MemoryReport(steps=(0, 1, 2), series={"host_rss": (1, 2, 3)})
        >>> render_svg(m).startswith("<svg")
        True
    """
    names = list(memory.series)
    height = _TOP + max(1, len(names)) * _PANEL + 24
    head = f"memory per step - {'LEAK' if memory.leak else 'no leak'}"
    head += f" ({memory.pattern})" if memory.pattern else ""
    out = [
        f'<svg id="memory-chart" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
        f'height="{height}" viewBox="0 0 {_WIDTH} {height}" font-family="sans-serif" '
        'role="img" aria-label="memory per step">',
        f'<rect width="{_WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{_LEFT}" y="18" font-size="14" font-weight="bold" '
        f'fill="{"#d62728" if memory.leak else "#222"}">{escape(head)}</text>',
    ]
    if not names:
        out.append(f'<text x="{_LEFT}" y="{_TOP + 40}" font-size="12">no series sampled</text>')
    for i, name in enumerate(names):
        out.extend(_panel(memory, name, _TOP + 16 + i * _PANEL))
    if memory.steps:
        out += [
            f'<text x="{_LEFT}" y="{height - 8}" font-size="10" fill="#555">step '
            f"{memory.steps[0]}</text>",
            f'<text x="{_WIDTH - _RIGHT}" y="{height - 8}" font-size="10" fill="#555" '
            f'text-anchor="end">step {memory.steps[-1]}</text>',
        ]
    out.append("</svg>")
    return "\n".join(out) + "\n"
