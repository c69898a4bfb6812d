"""Report: the plain records a session produces, their JSON, baselines, and renderers."""

from __future__ import annotations

from barrierguard.report.records import RENDERERS
from barrierguard.report.render import console, memory_chart

# The renderers import the records, so the records reach them through this
# table: ``str(report)`` and ``Report.save_memory_chart`` look them up here.
RENDERERS.update(console=console.render, memory_svg=memory_chart.render_svg)
