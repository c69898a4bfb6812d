"""A guard's view of torch.compile: listen while running, join to the sites at report time
(each graph break and CUDA-graph skip on the sync site at its line; other breaks apart)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from barrierguard.detect.compile_logs import CompileEvent, CompileListener
from barrierguard.report.records import (
    CaptureProbe,
    CompileReport,
    CudagraphSkip,
    GraphBreak,
    Site,
)

__all__ = ["CompileWatch", "dynamo_count", "frames_compiled", "join"]

# The dynamo flag that keeps a kind of sync in the graph, when dynamo's message names none.
_KIND_FLAG = {
    **dict.fromkeys(("item", "tolist", "int", "float"), "capture_scalar_outputs"),
    **dict.fromkeys(
        ("nonzero", "masked_select", "unique", "index", "dynamic_shape"),
        "capture_dynamic_output_shape_ops",
    ),
}


def dynamo_count(group: str, *names: str) -> int:
    """The sum of dynamo's ``counters[group][name]`` over ``names`` (0 without dynamo)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import counters

        return sum(int(counters[group][name]) for name in names)
    except Exception:
        return 0


def frames_compiled() -> int:
    """How many frames dynamo has been asked to compile in this process."""
    return dynamo_count("frames", "total")


class CompileWatch:
    """The listener of one guard, and the probe's result."""

    def __init__(self) -> None:
        self.listener = CompileListener()
        self.probe: CaptureProbe | None = None
        self._frames_at_start = self.frames = 0

    def start(self) -> None:
        self._frames_at_start = frames_compiled()
        self.listener.start()

    def stop(self) -> None:
        self.listener.stop()
        self.frames += max(0, frames_compiled() - self._frames_at_start)

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
    ``running``: the guard still runs (frames compiled since its start count)."""
    events = list(watch.listener.events)
    frames = watch.frames + (max(0, frames_compiled() - watch._frames_at_start) if running else 0)
    compile_syncs = sum(n for s in sites for phase, n in s.phases if phase == "compile")
    notes = tuple(watch.listener.notes) + tuple(
        f"internal error while reading torch's compile logs: {f}" for f in watch.listener.faults[:3]
    )
    if not events and not frames and not compile_syncs and watch.probe is None and not notes:
        return None
    breaks = _group(events, "graph_break")
    skips = _group(events, "cudagraph_skip")
    lines = {(s.file, s.line) for s in sites}
    break_at = {(f, ln): group[0] for (f, ln, _), group in breaks.items()}
    skip_at = {(f, ln): group[0].reason for (f, ln, _), group in skips.items() if f}
    out = []
    for s in sites:
        first = break_at.get((s.file, s.line))
        if first is not None:
            s = replace(
                s,
                graph_break=first.reason,
                graph_break_id=first.gb,
                compile_flag=first.flag or _KIND_FLAG.get(s.kind, ""),
            )
        skip = skip_at.get((s.file, s.line))
        out.append(replace(s, cudagraph_skip=skip) if skip else s)
    records = tuple(
        GraphBreak(
            file=file,
            line=line,
            reason=group[0].reason,
            function=group[0].function,
            detail=group[0].detail,
            gb=group[0].gb,
            flag=group[0].flag,
            count=len(group),
            sync=(file, line) in lines,
            user=group[0].user,
        )
        for (file, line, _), group in breaks.items()
    )
    report = CompileReport(
        graph_breaks=records,
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
