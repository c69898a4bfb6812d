"""JSON rendering of a report: the versioned schema of :meth:`Report.to_dict`."""

from __future__ import annotations

import json

from barrierguard.report.records import Report

__all__ = ["render"]


def render(report: Report) -> str:
    """Render ``report`` as indented JSON (what :meth:`Report.save` writes).

    Example:
        >>> from barrierguard import Report
        >>> '"schema": "barrierguard.report/1"' in render(Report("none", False, "record"))
        True
    """
    return json.dumps(report.to_dict(), indent=2) + "\n"
