"""What a guard measures besides the syncs: memory per step, and the step timeline.

:class:`MemoryReport` and :class:`Timeline` with their JSON; ``records``
re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from barrierguard.report.codec import Record

__all__ = ["MemoryReport", "Timeline"]


@dataclass(frozen=True)
class MemoryReport(Record):
    """Memory per step, and whether it kept growing: the report's ``memory`` section.

    ``series[name][i]`` is the value in bytes sampled at the end of step
    ``steps[i]`` (``None`` where that series could not be read then). Series:
    ``host_rss`` (this process), ``workers_rss`` (child processes such as
    DataLoader workers, when asked for), ``device_allocated`` and
    ``device_reserved`` (torch's CUDA caching allocator), ``device_used`` (the
    driver's view through NVML). ``slopes`` are robust growth rates in bytes per
    step over the measured (post warm-up) samples; ``leak`` is the verdict.

    Example:
        >>> m = MemoryReport(steps=(1, 2), series={"host_rss": (10, 10)})
        >>> MemoryReport.from_dict(m.to_dict()) == m
        True
    """

    steps: tuple[int, ...] = ()
    series: Mapping[str, tuple[int | None, ...]] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    verdict_series: tuple[str, ...] = ()
    slopes: Mapping[str, float] = field(default_factory=dict)
    growth_began_at: Mapping[str, int | None] = field(default_factory=dict)
    peak: Mapping[str, int] = field(default_factory=dict)
    peak_step: Mapping[str, int] = field(default_factory=dict)
    step_changes: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    growing: tuple[str, ...] = ()
    leak: bool = False
    threshold: int = 0
    warmup_steps: int = 0
    reason: str = ""
    pattern: str | None = None
    fix: str = ""
    evidence: str = ""
    sampling: str = ""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Timeline(Record):
    """Per measured step on a GPU: host time, stall, device time, run-ahead, saving.

    ``device_s[i]`` is ``None`` where the device time could not be measured
    without a sync (the host was not ahead, so the device idled in between).
    ``saving_s`` estimates what removing the syncs would save over the run;
    ``summary`` says it in words.

    Example:
        >>> t = Timeline(steps=(1,), host_s=(0.002,), stall_s=(0.001,), device_s=(None,),
        ...              ahead=(0,), saving_s=0.001, serialized=True, summary="...")
        >>> Timeline.from_dict(t.to_dict()) == t
        True
    """

    steps: tuple[int, ...] = ()
    host_s: tuple[float, ...] = ()
    stall_s: tuple[float, ...] = ()
    device_s: tuple[float | None, ...] = ()
    ahead: tuple[int, ...] = ()
    saving_s: float = 0.0
    saving_fraction: float = 0.0
    serialized: bool = False
    summary: str = ""
    sampling: str = ""
