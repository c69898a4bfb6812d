"""Report: the plain records a session produces, their JSON, baselines, and renderers."""

from __future__ import annotations

from barrierguard.report.records import RENDERERS
from barrierguard.report.render import console, memory_chart

RENDERERS.update(console=console.render, memory_svg=memory_chart.render_svg)
