"""The compile section of a report: graph breaks, CUDA-graph skips, the capture probe."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from barrierguard.report.codec import OMIT_EMPTY, OMIT_NONE, Record, to_json

__all__ = ["CaptureProbe", "CompileReport", "CudagraphSkip", "GraphBreak"]


class _Located(Record):
    """A record at a line (``file`` ``""`` when none is known), plain in JSON."""

    file: str
    line: int

    @property
    def location(self) -> str:
        """``basename:line``, or ``"-"`` when no line is known."""
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else "-"


@dataclass(frozen=True)
class GraphBreak(_Located):
    """One line where dynamo broke the graph, with dynamo's reason.

    ``count``: times logged; ``sync``: the line is also a sync site; ``user``: False
    when dynamo's stack held no line of the user's own.
    """

    file: str
    line: int
    reason: str
    function: str = ""
    detail: str = ""
    gb: str = ""
    flag: str = ""
    count: int = 1
    sync: bool = False
    user: bool = True


@dataclass(frozen=True)
class CudagraphSkip(_Located):
    """inductor's reason for not using CUDA graphs, at the user's line it names, if any."""

    reason: str
    file: str = ""
    line: int = 0
    function: str = ""
    count: int = 1


@dataclass(frozen=True)
class CaptureProbe(_Located):
    """What the capture probe found: one call captured with ``torch.cuda.graph``.

    ``status``: ``"capturable"`` (``reason``: what was taken from inductor's CUDA graphs),
    ``"blocked"`` (at ``file``/``line``, ``reason`` the error) or ``"not run"`` (and why).
    """

    status: str
    reason: str = ""
    file: str = ""
    line: int = 0
    function: str = ""
    code: str = ""
    captured: str = ""


@dataclass(frozen=True)
class CompileReport(Record):
    """What torch.compile and the capture probe said about the watched code;
    ``compile_syncs``: the syncs made while compiling, counted apart from the steps."""

    graph_breaks: tuple[GraphBreak, ...] = ()
    cudagraph_skips: tuple[CudagraphSkip, ...] = ()
    compile_syncs: int = 0
    probe: CaptureProbe | None = field(default=None, metadata=OMIT_NONE)
    notes: tuple[str, ...] = field(default=(), metadata=OMIT_EMPTY)

    @property
    def verdict(self) -> str:
        """One line: graph breaks, CUDA-graph skips, and whether the step is capturable."""
        n = len(self.graph_breaks)
        where = ", ".join(b.location for b in self.graph_breaks[:3]) + (", ..." if n > 3 else "")
        breaks = f"{n} graph break{'s' if n != 1 else ''} in the watched code ({where})"
        parts = [breaks if n else "no graph break in the watched code"]
        if self.cudagraph_skips:
            first = self.cudagraph_skips[0]
            parts.append(f"CUDA graphs skipped ({first.reason} at {first.location})")
        if (probe := self.probe) is None:
            parts.append("capture probe not run")
        elif probe.status == "capturable":
            tag = probe.reason.split(":", 1)[0]
            parts.append(f"the step is capturable ({tag})" if tag else "the step is capturable")
        elif probe.status == "blocked":
            parts.append(f"the step is not capturable: first blocked at {probe.location}")
        else:
            parts.append(f"capture probe not run ({probe.reason})")
        return "compile: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The section as JSON, its one-line verdict first (derived, not read back)."""
        return {"verdict": self.verdict, **to_json(self)}
