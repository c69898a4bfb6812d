"""What a guard measures besides the syncs: memory per step, and the step timeline.

:class:`MemoryReport` and :class:`Timeline` with their JSON; ``records``
re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MemoryReport", "Timeline"]


@dataclass(frozen=True)
class MemoryReport:
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

    def to_dict(self) -> dict[str, Any]:
        """The section as plain JSON-able data (the report's ``"memory"`` object)."""
        return {
            "steps": list(self.steps),
            "series": {k: list(v) for k, v in self.series.items()},
            "sources": dict(self.sources),
            "verdict_series": list(self.verdict_series),
            "slopes": dict(self.slopes),
            "growth_began_at": dict(self.growth_began_at),
            "peak": dict(self.peak),
            "peak_step": dict(self.peak_step),
            "step_changes": {k: [list(c) for c in v] for k, v in self.step_changes.items()},
            "growing": list(self.growing),
            "leak": self.leak,
            "threshold": self.threshold,
            "warmup_steps": self.warmup_steps,
            "reason": self.reason,
            "pattern": self.pattern,
            "fix": self.fix,
            "evidence": self.evidence,
            "sampling": self.sampling,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryReport:
        """Rebuild the section from :meth:`to_dict` output."""

        def _opt(v: Any) -> int | None:
            return None if v is None else int(v)

        return cls(
            steps=tuple(int(s) for s in data.get("steps", ())),
            series={k: tuple(_opt(v) for v in vs) for k, vs in data.get("series", {}).items()},
            sources={str(k): str(v) for k, v in data.get("sources", {}).items()},
            verdict_series=tuple(str(s) for s in data.get("verdict_series", ())),
            slopes={str(k): float(v) for k, v in data.get("slopes", {}).items()},
            growth_began_at={str(k): _opt(v) for k, v in data.get("growth_began_at", {}).items()},
            peak={str(k): int(v) for k, v in data.get("peak", {}).items()},
            peak_step={str(k): int(v) for k, v in data.get("peak_step", {}).items()},
            step_changes={
                str(k): tuple((int(a), int(b)) for a, b in v)
                for k, v in data.get("step_changes", {}).items()
            },
            growing=tuple(str(s) for s in data.get("growing", ())),
            leak=bool(data.get("leak", False)),
            threshold=int(data.get("threshold", 0)),
            warmup_steps=int(data.get("warmup_steps", 0)),
            reason=str(data.get("reason", "")),
            pattern=None if data.get("pattern") is None else str(data["pattern"]),
            fix=str(data.get("fix", "")),
            evidence=str(data.get("evidence", "")),
            sampling=str(data.get("sampling", "")),
            notes=tuple(str(n) for n in data.get("notes", ())),
        )


@dataclass(frozen=True)
class Timeline:
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "host_s": list(self.host_s),
            "stall_s": list(self.stall_s),
            "device_s": list(self.device_s),
            "ahead": list(self.ahead),
            "saving_s": self.saving_s,
            "saving_fraction": self.saving_fraction,
            "serialized": self.serialized,
            "summary": self.summary,
            "sampling": self.sampling,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        return cls(
            steps=tuple(int(x) for x in data.get("steps", ())),
            host_s=tuple(float(x) for x in data.get("host_s", ())),
            stall_s=tuple(float(x) for x in data.get("stall_s", ())),
            device_s=tuple(None if x is None else float(x) for x in data.get("device_s", ())),
            ahead=tuple(int(x) for x in data.get("ahead", ())),
            saving_s=float(data.get("saving_s", 0.0)),
            saving_fraction=float(data.get("saving_fraction", 0.0)),
            serialized=bool(data.get("serialized", False)),
            summary=str(data.get("summary", "")),
            sampling=str(data.get("sampling", "")),
        )
