"""A guard's view of torch.compile: listen while running, join to the sites at report time.

:class:`CompileWatch` runs the :class:`~barrierguard.detect.compiled.CompileListener`
beside the engine; :func:`join` puts each graph break and CUDA-graph skip on
the sync site at the same file and line (the site's compile consequence), and
builds the report's :class:`~barrierguard.report.records.CompileReport`, with
the breaks that are not syncs listed apart.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from barrierguard.detect.compiled import CompileEvent, CompileListener
from barrierguard.report.records import (
    CaptureProbe,
    CompileReport,
    CudagraphSkip,
    GraphBreak,
    Site,
)

__all__ = ["CompileWatch", "frames_compiled", "join"]

# The dynamo flag that keeps a kind of sync in the graph, when dynamo's own
# message names none.
_KIND_FLAG = {
    "item": "capture_scalar_outputs",
    "tolist": "capture_scalar_outputs",
    "int": "capture_scalar_outputs",
    "float": "capture_scalar_outputs",
    "nonzero": "capture_dynamic_output_shape_ops",
    "masked_select": "capture_dynamic_output_shape_ops",
    "unique": "capture_dynamic_output_shape_ops",
    "index": "capture_dynamic_output_shape_ops",
    "dynamic_shape": "capture_dynamic_output_shape_ops",
}


def frames_compiled() -> int:
    """How many frames dynamo has been asked to compile in this process (0 without it)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["total"])
    except Exception:
        return 0


class CompileWatch:
    """The listener of one guard, and the probe's result.

    Example:
        >>> w = CompileWatch()
        >>> w.start(); w.stop()
        >>> join([], w) is None
        True
    """

    def __init__(self) -> None:
        self.listener = CompileListener()
        self.probe: CaptureProbe | None = None
        self._frames_at_start = 0
        self.frames = 0

    def start(self) -> None:
        self._frames_at_start = frames_compiled()
        self.listener.start()

    def stop(self) -> None:
        self.listener.stop()
        self.frames += max(0, frames_compiled() - self._frames_at_start)

    @property
    def events(self) -> list[CompileEvent]:
        return list(self.listener.events)

    def skips(self) -> list[str]:
        """The CUDA-graph skips heard so far, ``"reason at file:line"`` (for the probe)."""
        return [
            f"{e.reason} at {os.path.basename(e.file)}:{e.line}" if e.file else e.reason
            for e in self.listener.events
            if e.what == "cudagraph_skip"
        ]


def _group(
    events: Sequence[CompileEvent], what: str
) -> dict[tuple[str, int, str], list[CompileEvent]]:
    grouped: dict[tuple[str, int, str], list[CompileEvent]] = {}
    for e in events:
        if e.what == what:
            key = (e.file, e.line, e.reason if what == "cudagraph_skip" else "")
            grouped.setdefault(key, []).append(e)
    return grouped


def join(
    sites: Sequence[Site], watch: CompileWatch, *, running: bool = False
) -> tuple[Sequence[Site], CompileReport] | None:
    """Sites with their compile consequence, and the compile section; ``None`` without compile.

    ``running``: the guard still runs (frames compiled since its start count).
    """
    events = watch.events
    frames = watch.frames + (max(0, frames_compiled() - watch._frames_at_start) if running else 0)
    compile_syncs = sum(n for s in sites for phase, n in s.phases if phase == "compile")
    notes = tuple(watch.listener.notes) + tuple(
        f"internal error while reading torch's compile logs: {f}" for f in watch.listener.faults[:3]
    )
    if not events and not frames and not compile_syncs and watch.probe is None and not notes:
        return None
    breaks = _group(events, "graph_break")
    skips = _group(events, "cudagraph_skip")
    by_line: dict[tuple[str, int], list[Site]] = {}
    for s in sites:
        by_line.setdefault((s.file, s.line), []).append(s)
    skip_at = {(f, ln): group[0].reason for (f, ln, _), group in skips.items() if f}
    records: list[GraphBreak] = []
    joined: dict[int, Site] = {}
    for (file, line, _), group in breaks.items():
        first = group[0]
        matched = by_line.get((file, line), [])
        records.append(
            GraphBreak(
                file=file,
                line=line,
                reason=first.reason,
                function=first.function,
                detail=first.detail,
                gb=first.gb,
                flag=first.flag,
                count=len(group),
                sync=bool(matched),
                user=first.user,
            )
        )
        for s in matched:
            joined[id(s)] = replace(
                s,
                graph_break=first.reason,
                graph_break_id=first.gb,
                compile_flag=first.flag or _KIND_FLAG.get(s.kind, ""),
            )
    out = []
    for s in sites:
        s = joined.get(id(s), s)
        skip = skip_at.get((s.file, s.line))
        if skip:
            s = replace(s, cudagraph_skip=skip)
        out.append(s)
    report = CompileReport(
        graph_breaks=tuple(records),
        cudagraph_skips=tuple(
            CudagraphSkip(
                reason=reason, file=file, line=line, function=group[0].function, count=len(group)
            )
            for (file, line, reason), group in skips.items()
        ),
        compile_syncs=compile_syncs,
        probe=watch.probe,
        notes=notes,
    )
    return out, report
